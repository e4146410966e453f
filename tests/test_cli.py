"""The typer CLI: overrides, +experiment, -m sweeps, --cfg job, bad overrides, resume, info."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers.cli import TINY, run, run_dir_of, runner

import certkv.eval.runner as runner_module
from certkv.cli import app
from certkv.config import CONF_DIR, compose_config
from certkv.eval.runner import validate
from certkv.report.markdown import summary_markdown

# runs read the offline books (the tiny experiment's NIAH): skip with a reason without them
pytestmark = pytest.mark.usefixtures("books")


@pytest.fixture
def out(tmp_path):
    return tmp_path / "runs"


def test_run_writes_a_complete_run_directory(out):
    result = run(*TINY, f"out_dir={out}", "ladder.k_max=64", "compile=false")
    assert result.exit_code == 0, result.output
    run_dir = run_dir_of(out / "tiny")
    assert "ladder.k_max=64" in run_dir.name and "compile=false" in run_dir.name
    names = {p.name for p in run_dir.iterdir()}
    assert {"config.yaml", "samples.jsonl", "certificates.jsonl", "summary.json"} <= names
    assert "k_max: 64" in (run_dir / "config.yaml").read_text()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["variants"]) == {"dense", "naive", "certified"}
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 2 * 3  # (perplexity + niah) x 3 variants
    assert "certified" in result.output and "E_key" in result.output
    assert "…" not in result.output  # long cells wrap, they are not cut
    assert {"README.md", "report.json", "run.json", "figures"} <= names  # the run's report
    meta = json.loads((run_dir / "run.json").read_text())
    assert {"commit", "threads", "torch", "command", "wall_s"} <= set(meta)
    assert "Quality against dense" in (run_dir / "README.md").read_text()
    markdown = summary_markdown(summary, "certkv run", "test machine")
    assert markdown.count("\n| ") == 2 + 3 and "| certified | K8/V4 |" in markdown


def test_rerun_resumes_instead_of_recomputing(out, monkeypatch):
    assert run(*TINY, f"out_dir={out}").exit_code == 0
    run_dir = run_dir_of(out / "tiny")
    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    (run_dir / "samples.jsonl").write_text("\n".join(lines[:2]) + "\n")  # "interrupted"
    certs = (run_dir / "certificates.jsonl").read_text().splitlines()
    (run_dir / "certificates.jsonl").write_text("\n".join(certs[:2]) + "\n")
    calls = []
    original = runner_module._record
    monkeypatch.setattr(runner_module, "_record",
                        lambda *a, **k: calls.append(a[3].name) or original(*a, **k))
    assert run(*TINY, f"out_dir={out}").exit_code == 0
    assert len(calls) == 4  # only the missing (task, sample, variant) records
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 6
    calls.clear()
    assert run(*TINY, f"out_dir={out}").exit_code == 0
    assert calls == []


def test_a_rerun_with_changed_settings_refuses_and_an_added_variant_resumes(out, monkeypatch):
    """An edited experiment file must not mix results: records whose variant or task now
    resolves differently stop the rerun with one sentence; a variant the run never had runs
    alone."""
    import yaml

    assert run(*TINY, f"out_dir={out}").exit_code == 0
    run_dir = run_dir_of(out / "tiny")
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    edited = {**config, "selector": {**config["selector"], "k_max": 3}}  # "made with k_max=3"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(edited))
    result = runner.invoke(app, ["run", *TINY, f"out_dir={out}"])
    assert result.exit_code == 2
    assert "holds records made with other settings (variant certified: selector.k_max: 3 ->" in \
        " ".join(result.output.split())
    # a run that never had the certified variant (and was made before the protect group
    # existed): only its records are computed
    config["variants"] = [v for v in config["variants"] if v["name"] != "certified"]
    del config["protect"], config["evict"]
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    for name in ("samples.jsonl", "certificates.jsonl"):
        rows = [x for x in (run_dir / name).read_text().splitlines() if '"certified"' not in x]
        (run_dir / name).write_text("\n".join(rows) + "\n")
    calls = []
    original = runner_module._record
    monkeypatch.setattr(runner_module, "_record",
                        lambda *a, **k: calls.append(a[3].name) or original(*a, **k))
    assert run(*TINY, f"out_dir={out}").exit_code == 0
    assert calls == ["certified", "certified"]


def test_a_run_directory_another_process_is_writing_refuses_and_is_free_once_it_exits(out):
    """Two runs into one directory would interleave their records: the second refuses with one
    sentence naming the holder; the lock dies with its holder (killed or not)."""
    assert run(*TINY, f"out_dir={out}").exit_code == 0
    run_dir = run_dir_of(out / "tiny")
    hold = ("import fcntl, os, sys, time; f = open(sys.argv[1], 'a+'); "
            "fcntl.flock(f, fcntl.LOCK_EX); f.truncate(0); f.write(str(os.getpid())); "
            "f.flush(); print('held', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", hold, str(run_dir / ".lock")],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = runner.invoke(app, ["run", *TINY, f"out_dir={out}"])
        assert result.exit_code == 2
        message = " ".join(result.output.split())
        assert f"another certkv process (pid {holder.pid}) is writing" in message
        assert str(run_dir) in message.replace(" ", "")  # a long path wraps
        assert "hydra.run.dir=" in message
    finally:
        holder.kill()
        holder.wait()
    assert run(*TINY, f"out_dir={out}").exit_code == 0  # resumes: nothing left to compute
    assert len((run_dir / "samples.jsonl").read_text().splitlines()) == 6


def test_multirun_sweep_uses_hydra_machinery(out):
    result = run(*TINY, f"out_dir={out}", "selector.k_max=4,8", "-m")
    assert result.exit_code == 0, result.output
    sweep = out / "multirun" / "tiny"
    assert (sweep / "multirun.yaml").exists()
    subdirs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert len([s for s in subdirs if "selector.k_max" in s]) == 2
    for s in subdirs:
        if "selector.k_max" in s:
            assert (sweep / s / "summary.json").exists()


def test_cfg_job_prints_the_composed_config():
    result = run("--cfg", "job")
    assert result.exit_code == 0
    assert "experiment: smoke" in result.output and "tau_cov: 0.995" in result.output


@pytest.mark.parametrize(("override", "expect"), [
    ("model=gpt7", "Choose one of: llama31_70b, llama31_8b, smollm2_135m, tiny_random."),
    ("selector.nonsense=1", "selector.nonsense is not a field of selector"),
    ("+experiment=nope", "Choose one of: compression_4k, evict_4k, evict_8k, evict_summaries_4k"),
    ("selector.k_max=3=4", "Valid config groups and options"),  # Hydra's grammar error
])
def test_bad_override_gives_message_and_options(override, expect):
    result = run(override)
    assert result.exit_code == 2
    assert expect in " ".join(result.output.split())  # rich wraps long lines
    assert "Traceback" not in result.output


def test_runtime_config_error_is_one_sentence(out):
    result = runner.invoke(app, ["run", *TINY, f"out_dir={out}", "selector.tau_cov=2"])
    assert result.exit_code == 2
    assert "tau_cov=2 must lie in [0, 1]" in " ".join(result.output.split())
    assert "Traceback" not in result.output


def test_typed_settings_of_a_task_left_out_are_one_sentence(out):
    result = runner.invoke(app, ["run", "+experiment=methods_4k", "task=[ruler]",
                                 "task.niah.trials=2", f"out_dir={out}"])
    assert result.exit_code == 2
    assert "task.niah has settings but no task" in " ".join(result.output.split())
    assert "~task.niah" in result.output and "Traceback" not in result.output
    assert not out.exists() or not any(out.iterdir())  # nothing written


@pytest.mark.parametrize("task", ["niah", "perplexity", "ruler", "smoke"])
def test_an_experiment_runs_any_task_option_with_its_own_settings(task):
    """``+experiment=tiny task=niah`` runs NIAH at tiny's settings; tiny's settings of the
    tasks left out (which name no task) are dropped instead of refused."""
    cfg = compose_config(["+experiment=tiny", f"task={task}"])
    names = {"smoke": ["perplexity", "niah"]}.get(task, [task])
    assert sorted(cfg.task) == sorted(names)
    assert all(node.context == 2048 for node in cfg.task.values())
    validate(cfg)


def test_info_lists_groups_and_versions():
    result = runner.invoke(app, ["info"])
    assert result.exit_code == 0
    for text in ("quantizer", "int8_int4", "smollm2_135m", "torch", "device"):
        assert text in result.output


@pytest.mark.parametrize(("experiment", "sizes", "table"), [
    ("ruler_4k", ["task.ruler.context=1024", "task.ruler.slices=1", "logger=wandb",
                  "task.ruler.subtasks=[niah_single,vt]"],
     "RULER accuracy per subtask"),
    ("niah_4k", ["task.niah.context=900", "task.niah.trials=1", "task.niah.max_new_tokens=3"],
     "NIAH (niah_4k"),
    ("pg19_4k", ["task.perplexity.context=128", "task.perplexity.windows=2",
                 "task.perplexity.decode_tokens=4"], "Perplexity per window"),
])
def test_paper_experiments_end_to_end_on_a_tiny_model(out, monkeypatch, experiment, sizes,
                                                       table):
    """Each evaluation task through `certkv run` on tiny_random: every method, the report in
    the run directory (and a W&B run, offline), then `certkv report` from the directory alone."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = run(f"+experiment={experiment}", "model=tiny_random", *sizes, f"out_dir={out}")
    assert result.exit_code == 0, result.output
    run_dir = run_dir_of(out / experiment)
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines()]
    expected = {"dense", "naive", "certified", "certified-fp16v"}
    if experiment == "ruler_4k":  # tight vs paper rules (value_policy.contribution, tail_mass)
        expected.add("certified-paper")
    assert {s["variant"] for s in samples} == expected
    assert table in (run_dir / "README.md").read_text()
    if "logger=wandb" in sizes:
        assert list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    again = runner.invoke(app, ["report", str(run_dir), "--out", str(out / "rep")])
    assert again.exit_code == 0 and table in (out / "rep" / "README.md").read_text()


def test_a_long_override_gets_a_short_run_directory(out):
    """A variants list on the command line would make Hydra's directory name too long for the
    file system: it is cut and completed by a hash of the whole."""
    variants = ("variants=[{name: dense, mode: dense}, {name: naive, mode: naive}, "
                "{name: naive-k2, mode: naive, quantizer: {key_codec: {bits: 2}}}]")
    result = run(*TINY, variants, f"out_dir={out}")
    assert result.exit_code == 0, result.output
    name = run_dir_of(out / "tiny").name
    assert len(name) <= 120 and name.startswith("task.")


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob(
    "*.yaml")))
def test_every_experiment_builds_its_variants(experiment):
    """Each committed experiment composes, validates and instantiates every variant (a typo
    in a long variants list fails here, not hours into a run)."""
    from certkv.eval.runner import build_variants

    cfg = compose_config([f"+experiment={experiment}"])
    validate(cfg)
    variants = build_variants(cfg)
    assert variants and len({v.name for v in variants}) == len(variants)
