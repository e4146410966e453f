"""Running the CLI in a test: the tiny experiment at its smallest, a run's directory, its
report (test_cli.py, test_evict.py, test_faults.py, ...)."""

from __future__ import annotations

from typer.testing import CliRunner

from certkv.cli import app

runner = CliRunner()
# the tiny experiment at its smallest: one needle trial, three decode steps
TINY = ["+experiment=tiny", "task.perplexity.decode_tokens=3", "task.niah.trials=1",
        "task.niah.max_new_tokens=2"]


def run(*args):
    return runner.invoke(app, ["run", *args], catch_exceptions=False)


def run_dir_of(root):
    """The single run directory below ``root`` (named after the overrides)."""
    (found,) = {p.parent for p in root.rglob("samples.jsonl")}
    return found


def tiny_report(tmp_path, *overrides: str, section: str):
    """Run ``+experiment=tiny`` with ``overrides`` into ``tmp_path``; returns its run directory
    and the text of its README from the heading ``section`` on."""
    result = run(*TINY, *overrides, f"out_dir={tmp_path}")
    assert result.exit_code == 0, result.output
    run_dir = run_dir_of(tmp_path / "tiny")
    text = (run_dir / "README.md").read_text()
    return run_dir, text[text.index(f"## {section}"):]
