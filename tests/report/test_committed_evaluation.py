"""Issue 57: the hand-made tables of ``reports/evaluation.md`` and ``reports/tight_vs_paper.md``
are what the committed runs give.

Each experiment row names a committed run (``reports/<name>/run``) and each method column a
variant of it; every number a cell prints is recomputed from the run's raw records with the
report's own functions (:func:`~certkv.report.tables.quality_delta`,
:func:`~certkv.eval.summary.certificate_summary`, :func:`~certkv.report.tables.median_step_ms`)
and must agree to the digits printed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.committed import NUMBER, agrees, tables

from certkv.eval.summary import certificate_summary
from certkv.report.tables import RunData, median_step_ms, quality_delta

ROOT = Path(__file__).resolve().parents[2]
EVALUATION = ROOT / "reports" / "evaluation.md"
# a table row's experiment -> (task, run directory) for the CPU runs, the H100 runs
RUNS = {"RULER 4K": ("ruler", "ruler_4k"), "RULER 8K": ("ruler", "ruler_8k"),
        "NIAH 4K": ("niah", "niah_4k"), "PG-19 protocol 4K": ("perplexity", "pg19_4k")}
COLUMNS = {"dense": "dense", "naive": "naive", "certified": "certified",
           "certified, FP16 values": "certified-fp16v"}


def evaluation_tables(second: str) -> list[tuple[list[str], list[list[str]]]]:
    """The document's tables whose header reads ``experiment | <second> | ...``, in order."""
    return [t for t in tables(EVALUATION.read_text()) if t[0][:2] == ["experiment", second]]


def experiment(name: str, h100: bool) -> tuple[str, RunData]:
    key = next(k for k in RUNS if name.startswith(k))
    task, run = RUNS[key]
    return task, RunData.load(ROOT / "reports" / (run if h100 else f"{run}_cpu") / "run")


def check_quality(cell: str, q: dict | None) -> int:
    """``value (delta [lo, hi])``, ``value (delta)`` (no interval printed: it is [0, 0], or
    there is one sample),
    ``= dense (delta)`` (the method's value is dense's) or ``-`` (not run)."""
    if cell == "-":
        assert q is None
        return 0
    delta = q["delta"]
    tokens = NUMBER.findall(cell)
    if cell.startswith("= dense"):
        assert q["method"] == q["dense"], cell
        values = [delta.estimate]
    else:
        values = [q["method"], delta.estimate]
    if len(tokens) > len(values):
        values += [delta.low, delta.high]
    else:
        assert delta.n <= 1 or delta.low == delta.high == 0.0, cell
    assert len(tokens) == len(values), cell
    for token, value in zip(tokens, values, strict=True):
        assert agrees(token, value), (cell, token, value)
    return len(tokens)


@pytest.mark.parametrize("h100", [False, True], ids=["cpu", "h100"])
def test_the_quality_tables_are_their_runs(h100):
    cpu, gpu = evaluation_tables("dense")  # the CPU runs, then the H100 runs
    header, rows = gpu if h100 else cpu
    checked = 0
    for row in rows:
        task, run = experiment(row[0], h100)
        assert agrees(NUMBER.findall(row[1])[0], quality_delta(run, task, "naive")["dense"])
        for column, cell in zip(header[2:], row[2:], strict=True):
            variant = COLUMNS[column]
            q = quality_delta(run, task, variant) if variant in run.variants else None
            checked += check_quality(cell, q)
    assert checked >= 20


def test_the_certificate_table_is_its_runs():
    """Rungs 0-3 in percent, K*, value promotions per layer step, the medians of E_key /
    E_val / E_arith and of the paper-form E_key / E_val of each certified variant."""
    (_, rows), = evaluation_tables("method")
    assert len(rows) >= 6
    for row in rows:
        _, run = experiment(row[0], False)
        cert = certificate_summary(run.certificate_records(row[1]))
        values = [*(100 * r for r in cert["rung_rates"][:4]), cert["k_star_mean"],
                  cert["value_promotions_per_step"], cert["e_key"]["median"],
                  cert["e_val"]["median"], cert["e_arith"]["median"],
                  cert["paper_e_key"]["median"], cert["paper_e_val"]["median"]]
        tokens = [t for cell in row[2:] for t in NUMBER.findall(cell)]
        assert len(tokens) == len(values), row
        for token, value in zip(tokens, values, strict=True):
            assert agrees(token, value), (row[:2], token, value)


def test_the_speed_table_is_its_runs():
    """Median whole-model decode step of each variant, and its ratio to dense's."""
    (header, rows), = evaluation_tables("dense ms / step")
    for row in rows:
        _, run = experiment(row[0], False)
        dense = median_step_ms(run, "dense")
        assert agrees(row[1], dense), row
        for column, cell in zip(header[2:], row[2:], strict=True):
            ms, ratio = NUMBER.findall(cell)
            method = median_step_ms(run, COLUMNS[column])
            assert agrees(ms, method) and agrees(ratio, method / dense), (row[0], column)


def test_the_tight_against_paper_table_is_its_runs():
    """``reports/tight_vs_paper.md``: rungs 2 / 1 / 0 in percent, K*, value promotions and
    host-to-device MiB per step, the median step, and quality against dense, per rule set
    (``tight``: the variant ``certified``; ``paper``: ``certified-paper``)."""
    (_, rows), = [t for t in tables((ROOT / "reports" / "tight_vs_paper.md").read_text())
                  if t[0][:2] == ["experiment", "rules"]]
    assert len(rows) == 4
    runs = {"smoke": "reports/smoke/run", "RULER 4K": "reports/tight_vs_paper/ruler_4k/run"}
    for row in rows:
        run = RunData.load(ROOT / runs[row[0].split(" (")[0]])
        variant = {"tight": "certified", "paper": "certified-paper"}[row[1]]
        cert = certificate_summary(run.certificate_records(variant))
        values = [*(100 * cert["rung_rates"][k] for k in (2, 1, 0)), cert["k_star_mean"],
                  cert["value_promotions_per_step"], cert["h2d_bytes_per_step"] / 2**20,
                  median_step_ms(run, variant)]
        for token, value in zip(row[2:9], values, strict=True):
            assert agrees(token, value), (row[:2], token, value)
        assert 0.002 <= cert["rung_rates"][3] <= 0.0035, row[:2]  # "0.2-0.3% for both"
        for task, token in re.findall(r"(ppl|NIAH) ([-+]\d+(?:\.\d+)?)", row[9]) or [
                ("ruler", NUMBER.findall(row[9])[0])]:
            q = quality_delta(run, {"ppl": "perplexity"}.get(task, task.lower()), variant)
            assert agrees(token, q["delta"].estimate), (row[:2], task)
