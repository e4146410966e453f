"""`certkv report` and the W&B logger on hand-made run directories with known answers."""

from __future__ import annotations

import json
import math

import pytest
from helpers.report import rec, ruler_run, write_run
from typer.testing import CliRunner

from certkv.cli import app
from certkv.eval import stats
from certkv.eval.results import RunDir
from certkv.report.document import build_report, write_report
from certkv.report.tables import RunData, quality_delta


def test_ruler_tables_from_a_run_directory(tmp_path):
    run = RunData.load(ruler_run(tmp_path))
    q = quality_delta(run, "ruler", "certified")
    assert q["dense"] == 1.0 and q["method"] == 0.75 and q["n"] == 4
    assert (q["mcnemar"].critical, q["mcnemar"].reverse, q["mcnemar"].p_value) == (1, 0, 1.0)
    expected = stats.clustered_bootstrap_delta([1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 1, 1],
                                               seed=stats.seed_for("ruler_4k", "ruler", 4096,
                                                                   "certified"))
    assert q["delta"] == expected
    report = build_report([run.root])
    titles = [t.title for t in report.tables]
    assert any("RULER accuracy per subtask" in t for t in titles)
    per_subtask = next(t for t in report.tables if "per subtask" in t.title)
    assert [r[0] for r in per_subtask.rows] == ["niah_single", "vt", "all"]
    assert per_subtask.rows[1][1] == "1.000" and per_subtask.rows[1][2].startswith("0.500")


def test_partial_runs_render_on_the_finished_pairs(tmp_path):
    run = RunData.load(ruler_run(tmp_path, drop_last=True))
    assert quality_delta(run, "ruler", "certified")["n"] == 3


def test_a_run_resumed_on_other_code_says_which_records_each_commit_made(tmp_path):
    root = ruler_run(tmp_path, drop_last=True)
    run = RunDir(root)
    run.start_session({"commit": "abc", "threads": 2})  # the same environment: one session
    assert [s["commit"] for s in run.read_meta()["sessions"]] == ["abc"]
    run.start_session({"commit": "def", "threads": 2})  # resumed after a commit
    meta = run.read_meta()
    assert meta["commit"] == "def"
    assert [(s["commit"], s["from_record"]) for s in meta["sessions"]] == [("abc", 0),
                                                                           ("def", 7)]
    (line,) = build_report([root]).provenance()
    assert "records 0+: commit `abc`" in line and "; then records 7+: commit `def`" in line


def test_niah_and_perplexity_tables(tmp_path):
    samples = []
    for i, (d, c) in enumerate([(True, True), (True, False), (False, True), (True, True)]):
        samples += [rec("niah", i, "dense", accuracy=1.0 if d else 0.9, **{"pass": d}),
                    rec("niah", i, "certified", accuracy=1.0 if c else 0.8, **{"pass": c})]
    for i, (d, c) in enumerate([(10.0, 10.1), (20.0, 20.3)]):
        samples += [rec("perplexity", i, "dense", nll=100 * math.log(d), tokens=100, ppl=d,
                        document="emma"),
                    rec("perplexity", i, "certified", nll=100 * math.log(c), tokens=100, ppl=c,
                        document="emma")]
    run = RunData.load(write_run(tmp_path / "mixed", "mixed", samples))
    niah = quality_delta(run, "niah", "certified")
    assert (niah["mcnemar"].both_pass, niah["mcnemar"].critical, niah["mcnemar"].reverse,
            niah["mcnemar"].both_fail) == (2, 1, 1, 0)
    ppl = quality_delta(run, "perplexity", "certified")
    assert ppl["dense"] == pytest.approx(math.sqrt(200.0))  # exp of the mean NLL per token
    assert ppl["method"] == pytest.approx(math.sqrt(10.1 * 20.3))
    # the delta is the pooled values' difference, not the mean of per-window ones (0.2)
    assert ppl["delta"].estimate == pytest.approx(ppl["method"] - ppl["dense"])
    assert ppl["delta"] == stats.paired_perplexity_delta(
        [(100 * math.log(10.0), 100), (100 * math.log(20.0), 100)],
        [(100 * math.log(10.1), 100), (100 * math.log(20.3), 100)])
    out = write_report(build_report([run.root]), tmp_path / "out")
    text = out.read_text()
    assert "NIAH (mixed" in text and "Perplexity per window" in text and "commit `abc`" in text
    assert (tmp_path / "out" / "figures" / "mixed_perplexity_deltas.png").exists()
    assert (tmp_path / "out" / "figures" / "mixed_rungs.png").exists()
    tables = json.loads((tmp_path / "out" / "report.json").read_text())["tables"]
    runtime = next(t for t in tables if t["title"].startswith("Ladder"))
    assert runtime["rows"][1][1] == "50/10/30/10/0" and runtime["rows"][1][-1] == "2.50"


def test_one_perplexity_window_says_it_has_no_interval(tmp_path):
    samples = [rec("perplexity", 0, "dense", nll=100 * math.log(10.0), tokens=100, ppl=10.0,
                   document="emma"),
               rec("perplexity", 0, "certified", nll=100 * math.log(10.5), tokens=100, ppl=10.5,
                   document="emma")]
    report = build_report([write_run(tmp_path / "one", "one", samples)])
    quality = next(t for t in report.tables if t.title.startswith("Quality"))
    cell = next(c for c in quality.rows[0] if c.startswith("+0.500"))
    assert cell == "+0.500 [no CI: n=1]"


def test_a_perplexity_delta_is_the_value_minus_dense_of_the_pooled_perplexities(tmp_path):
    """Issue 57: the value column is pooled over windows, so the delta is too; here a mean of
    per-window differences would even have the other sign (-0.66 against +0.379)."""
    windows = {"dense": [(300.0, 100), (100.0, 100)], "certified": [(290.0, 100), (120.0, 100)]}
    samples = [rec("perplexity", i, v, nll=nll, tokens=n, ppl=math.exp(nll / n),
                   document="emma")
               for v, ws in windows.items() for i, (nll, n) in enumerate(ws)]
    report = build_report([write_run(tmp_path / "two", "two", samples)])
    row = next(t for t in report.tables if t.title.startswith("Quality")).rows[0]
    at = row.index("certified")
    dense, value, delta = float(row[at + 1]), float(row[at + 2]), row[at + 3]
    assert (dense, value) == (7.389, 7.768)  # e^2, e^2.05
    assert delta.startswith("+0.379 [")
def test_report_command(tmp_path):
    runner = CliRunner()
    run_dir = ruler_run(tmp_path)
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "rep" / "README.md").exists()
    assert (tmp_path / "rep" / "figures" / "ruler_4k_ruler_subtasks.png").exists()
    bad = runner.invoke(app, ["report", str(tmp_path / "nope")])
    assert bad.exit_code == 2 and "no such run directory" in bad.output


def test_a_committed_report_refreshes_wherever_its_checkout_lies(tmp_path):
    """report.json names its runs relative to itself (no machine's absolute path), so a
    report beside its run, moved with it (another clone), refreshes in place; a report of
    other runs is still refused."""
    import shutil

    runner = CliRunner()
    home = tmp_path / "clone1" / "reports" / "r"
    run_dir = ruler_run(home)
    assert runner.invoke(app, ["report", str(run_dir), "--out", str(home)]).exit_code == 0
    assert json.loads((home / "report.json").read_text())["runs"] == ["ruler_4k"]
    moved = tmp_path / "clone2" / "reports" / "r"
    shutil.copytree(home, moved)
    again = runner.invoke(app, ["report", str(moved / "ruler_4k"), "--out", str(moved)])
    assert again.exit_code == 0, again.output
    other = runner.invoke(app, ["report", str(run_dir), "--out", str(moved)])
    assert other.exit_code != 0 and "--force" in other.output


def test_wandb_logger_offline(tmp_path, monkeypatch):
    """A real offline W&B run (no account, no network): config, per-step certificates, the
    samples table, the report's tables and figures, the quality summary."""
    import wandb

    from certkv.report.wandb_logger import WandbLogger

    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = ruler_run(tmp_path)
    report = build_report([run_dir])
    write_report(report, run_dir)
    logged, summary = [], {}
    original = wandb.sdk.wandb_run.Run.log

    def spy(self, data, *args, **kwargs):
        logged.append(dict(data))
        return original(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", spy)
    finish = wandb.sdk.wandb_run.Run.finish
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "finish",
                        lambda self, *a, **k: (summary.update(dict(self.summary)),
                                               finish(self, *a, **k))[1])
    WandbLogger(mode="offline").log(report, {}, str(run_dir))
    keys = {k for d in logged for k in d}
    assert {"certificate/certified/e_key", "certificate/certified/bound", "samples"} <= keys
    assert any(k.startswith("tables/") for k in keys)
    assert any(k.startswith("figures/") for k in keys)
    assert summary["quality/ruler/certified/accuracy"] == 0.75
    offline = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert offline and offline[0].stat().st_size > 0
