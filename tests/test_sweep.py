"""`certkv sweep`: the paper's knobs and custom axes as Hydra multiruns on the tiny model, the
joblib and submitit launchers, skipped finished points, recorded failed points, the aggregate."""

from __future__ import annotations

import json

import pytest
from helpers.cli import TINY, runner

from certkv.cli import app
from certkv.errors import ConfigError
from certkv.sweep import KNOBS, knob_axes, multirun_args, parse_axis

# runs read the offline books (the tiny experiment's NIAH): skip with a reason without them
pytestmark = pytest.mark.usefixtures("books")


def sweep(*args):
    return runner.invoke(app, ["sweep", *args], catch_exceptions=False)


def aggregate(root):
    return json.loads((root / "sweep.json").read_text())["table"]


def test_knobs_carry_the_papers_grids():
    assert knob_axes("kmax", None) == {"selector.k_max": ["64", "128", "256", "512"]}
    assert knob_axes("vtol", "0.02, 0.05") == {"value_policy.v_tol": ["0.02", "0.05"]}
    assert knob_axes("scratch", "256", "64,128") == {
        "cache.scratch_key_blocks": ["256"], "cache.scratch_value_blocks": ["64", "128"]}
    assert set(KNOBS) == {"kmax", "vtol", "group", "scratch"}


@pytest.mark.parametrize("call, message", [
    (lambda: knob_axes("vtol", " , "), "grid is empty"),
    (lambda: knob_axes("nope", None), "unknown sweep 'nope'"),
    (lambda: parse_axis("v_tol"), "is not a sweep axis"),
    (lambda: multirun_args("vtol", {"value_policy.v_tol": ["1"]}, ["value_policy.v_tol=2"]),
     "sets a field this sweep varies"),
])
def test_bad_sweeps_are_one_sentence(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_vtol_sweep_with_two_joblib_workers_then_skips_finished_points(tmp_path):
    args = ["vtol", *TINY, f"out_dir={tmp_path}", "--values", "0.02,0.1",
            "hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    result = sweep(*args)
    assert result.exit_code == 0, result.output
    root = tmp_path / "sweeps" / "vtol" / "tiny"
    table = aggregate(root)
    assert [(r[0], r[1]) for r in table["rows"]] == [
        ("v_tol=0.02", "naive"), ("v_tol=0.02", "certified"),
        ("v_tol=0.1", "naive"), ("v_tol=0.1", "certified")]
    assert "niah delta [95% CI]" in table["head"]
    assert (root / "figures" / "sweep_vtol.png").exists()
    assert "2 points (0 failed)" in result.output
    written = {p: p.stat().st_mtime_ns for p in root.rglob("run.json")}
    again = sweep(*args)  # every point finished: skipped, nothing rewritten
    assert again.exit_code == 0 and len(written) == 2
    assert {p: p.stat().st_mtime_ns for p in root.rglob("run.json")} == written


def test_a_failing_point_is_recorded_and_the_others_run(tmp_path):
    result = sweep("group", *TINY, f"out_dir={tmp_path}", "--values", "8,64")
    assert result.exit_code == 1, result.output  # after every point ran, naming the failed one
    root = tmp_path / "sweeps" / "group" / "tiny"
    (point,) = root.glob("quantizer.value_codec.group=64*")
    failed = json.loads((point / "failed.json").read_text())
    assert "does not divide head_dim=32" in failed["error"]
    assert "1 sweep point(s) failed" in " ".join(result.output.split())
    assert not (point / "samples.jsonl").exists()
    rows = aggregate(root)["rows"]
    assert [r[:2] for r in rows] == [["group=8", "naive"], ["group=8", "certified"],
                                     ["group=64", "failed"]]
    assert "2 points (1 failed)" in result.output
    # the point that ran shows its quality table and where its full report is, not all of it
    text = " ".join(result.output.split())
    assert text.count("Quality against dense") >= 1 and "full report:" in text
    assert "Certificates (" not in text and "Ladder, cache and speed" not in text
    (listed,) = [line for line in (root / "README.md").read_text().splitlines()
                 if "failed:" in line]
    assert "does not divide head_dim=32" in listed and "`?`" not in listed  # nothing ran


def test_custom_axes_through_submitit_with_the_aggregate_on_wandb(tmp_path, monkeypatch):
    """Custom axes through the submitit_local launcher; with logger=wandb every point is a W&B
    run and the aggregate one more (offline)."""
    import wandb

    monkeypatch.setenv("WANDB_SILENT", "true")
    logged = []
    original = wandb.sdk.wandb_run.Run.log
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log",
                        lambda self, data, *a, **k: (logged.append(dict(data)),
                                                     original(self, data, *a, **k))[1])
    result = sweep("custom", "ladder.k_max=8,16", *TINY, f"out_dir={tmp_path}",
                   "hydra/launcher=submitit_local", "logger=wandb", "--out", str(tmp_path / "agg"))
    assert result.exit_code == 0, result.output
    rows = aggregate(tmp_path / "agg")["rows"]
    assert [r[0] for r in rows] == ["k_max=8", "k_max=8", "k_max=16", "k_max=16"]
    assert (tmp_path / "agg" / "README.md").exists()
    keys = {k for d in logged for k in d}
    assert {"sweep/k_max", "sweep/k_max_figure"} <= keys
    root = tmp_path / "sweeps" / "k_max" / "tiny"
    assert list((root / "wandb").glob("offline-run-*"))


@pytest.mark.parametrize("args, message", [
    (["vtol", "hydra/launcher=nope"], "unknown launcher 'nope'"),
    (["vtol", "--values", ","], "grid is empty"),
    (["custom", "+experiment=tiny"], "needs at least one axis"),
    (["kmax", "selector.k_max=3"], "sets a field this sweep varies"),
])
def test_sweep_command_errors(args, message):
    result = runner.invoke(app, ["sweep", *args])
    assert result.exit_code == 2 and message in " ".join(result.output.split())


def test_slurm_gpu_launcher_config_composes():
    from hydra import compose, initialize_config_dir

    from certkv.config import CONF_DIR

    with initialize_config_dir(str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["hydra/launcher=slurm_gpu"],
                      return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.gpus_per_node == 1
