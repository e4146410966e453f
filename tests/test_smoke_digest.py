"""Refactoring changes no number (issue 53): the tiny smoke run (SmolLM2 offline: perplexity
and NIAH, dense, naive and certified) gives exactly the generations, losses and certificate
summaries pinned here. A change that means to move them updates :data:`PINNED` and says why
in its commit."""

from __future__ import annotations

import hashlib
import json

import pytest
from typer.testing import CliRunner

from certkv.cli import app

# sha256 (first 16 hex digits) of samples.jsonl then certificates.jsonl, timings dropped
PINNED = "695be7163a695138"
TIMINGS = ("ms_per_step",)


def digest(run) -> str:
    """The run's records without their timings, keys sorted, hashed in file order."""
    h = hashlib.sha256()
    for name in ("samples.jsonl", "certificates.jsonl"):
        for line in (run / name).read_text().splitlines():
            record = {k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            h.update(json.dumps(record, sort_keys=True).encode())
    return h.hexdigest()[:16]


@pytest.mark.slow
def test_the_tiny_run_gives_the_pinned_generations_and_certificates(tmp_path):
    result = CliRunner().invoke(app, ["run", "+experiment=tiny", f"out_dir={tmp_path}"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (run,) = {p.parent for p in tmp_path.rglob("samples.jsonl")}
    records = (run / "samples.jsonl").read_text().splitlines()
    assert len(records) == 9 and all("ms_per_step" in json.loads(r) for r in records)
    assert digest(run) == PINNED
