"""Issue 57: every committed run report is what ``certkv report`` makes of its committed raw
records, line for line: a reader who recomputes the tables gets the numbers the README prints."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from helpers.committed import cells as row_cells

from certkv.report.document import build_report, markdown_lines
from certkv.report.tables import RunData, fmt, fmt_interval, quality_delta

ROOT = Path(__file__).resolve().parents[2]
REPORTS = sorted(p.parent for p in (ROOT / "reports").rglob("report.json"))


def test_every_committed_report_has_its_raw_records_beside_it():
    assert REPORTS, "no committed run report found under reports/"
    for report in REPORTS:
        runs = json.loads((report / "report.json").read_text())["runs"]
        missing = [r for r in runs if not (report / r / "samples.jsonl").is_file()]
        assert not missing, f"{report.relative_to(ROOT)}: raw records not committed: {missing}"


def test_committed_runs_keep_their_certificate_records_packed():
    """Plain certificate records are about three times their gzip copy; the working tree (which
    a lent GPU machine receives whole, 64 MiB at most) keeps the packed ones."""
    plain = [str(p.relative_to(ROOT)) for p in (ROOT / "reports").rglob("certificates.jsonl")]
    assert not plain, f"pack them: .venv/bin/python scripts/pack_runs.py reports ({plain})"


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: str(p.relative_to(ROOT / "reports")))
def test_a_committed_report_is_recomputed_from_its_raw_records(report, monkeypatch):
    monkeypatch.chdir(ROOT)  # run directories print as the paths the report was made with
    runs = json.loads((report / "report.json").read_text())["runs"]
    paths = [os.path.relpath(report / r, ROOT) for r in runs]
    text = (report / "README.md").read_text().split("\n")
    committed = [line for line in text if not line.startswith("![")]
    while committed and committed[-1] == "":
        committed.pop()
    recomputed = markdown_lines(build_report(paths))
    while recomputed and recomputed[-1] == "":
        recomputed.pop()
    assert recomputed == committed


SUMMARIES = {"reports/methods/README.md": {"4K": "reports/methods/methods_4k/run",
                                           "8K": "reports/methods/methods_8k/run"}}


@pytest.mark.parametrize("path", sorted(SUMMARIES))
def test_a_hand_written_summary_quotes_the_quality_its_raw_records_give(path, monkeypatch):
    """The summary tables a README assembles by hand (rows named by method, under a ``## 4K``
    / ``## 8K`` heading or a ``method (4K)`` header) print each quality cell as the run
    reports would: ``value (delta [95% CI])``, or ``value (delta)`` without a CI column."""
    monkeypatch.chdir(ROOT)
    runs = {ctx: RunData.load(run) for ctx, run in SUMMARIES[path].items()}
    checked = 0
    for ctx, header, cells in _summary_rows((ROOT / path).read_text()):
        run = runs[ctx]
        if cells[0] not in run.variants:
            continue
        for name, cell in zip(header, cells, strict=True):
            task = name.split()[0]
            q = quality_delta(run, task, cells[0]) if task in run.tasks else None
            if q is None:
                continue
            delta = fmt_interval(q["delta"]) if "CI" in name else f"{q['delta'].estimate:+.3f}"
            assert cell == f"{fmt(q['method'])} ({delta})", (path, ctx, cells[0], task)
            checked += 1
    assert checked > 50, f"{path}: only {checked} quality cells found"


def _summary_rows(text: str):
    """``(context, header, cells)`` of every table row below a context heading."""
    ctx, header = None, None
    for line in text.split("\n"):
        if line.startswith("## "):
            ctx = next((c for c in ("4K", "8K") if c in line), ctx)
        if not line.startswith("|"):
            header = None
            continue
        cells = row_cells(line)
        if header is None:
            header = cells
            named = re.search(r"\((\dK)\)", cells[0])
            table_ctx = named.group(1) if named else ctx
        elif not set(cells[0]) <= {"-"} and table_ctx is not None:
            yield table_ctx, header, cells


BUDGET_TABLES = {"4K": "reports/evict/evict_4k/run", "8K": "reports/evict/evict_8k/run"}


def test_the_eviction_readme_quotes_the_deltas_its_raw_records_give(monkeypatch):
    """reports/evict/README.md's hand-assembled tables (kvpress beside certkv): each row names
    its variants with ``*`` for the budget, each ``ppl / NIAH / RULER`` cell is that variant's
    delta to dense in the run of the table's context (``-``: no such variant)."""
    monkeypatch.chdir(ROOT)
    runs, checked, ctx, budgets = {}, 0, None, []
    for line in (ROOT / "reports/evict/README.md").read_text().split("\n"):
        if not line.startswith("|"):
            ctx = None  # a table ends at its first other line
            continue
        cells = row_cells(line)
        header = re.match(r"variants at (\dK)", cells[0])
        if header:
            ctx, budgets = header.group(1), [re.match(r"\d+", c).group() for c in cells[1:]]
            continue
        named = re.match(r"`([^`]*\*[^`]*)`", cells[0])
        if not named or ctx is None:
            continue
        run = runs.setdefault(ctx, RunData.load(BUDGET_TABLES[ctx]))
        for budget, cell in zip(budgets, cells[1:], strict=True):
            variant = named.group(1).replace("*", budget)
            if cell == "-":
                assert variant not in run.variants, variant
                continue
            want = " / ".join(f"{quality_delta(run, task, variant)['delta'].estimate:+.2f}"
                              for task in ("perplexity", "niah", "ruler"))
            assert cell == want, (ctx, variant)
            checked += 1
    assert checked >= 20, f"only {checked} cells found"


# runs whose variants a README tabulates by hand under a ``variants (<experiment>)`` header
VARIANT_TABLES = {"methods_4k": "reports/methods/methods_4k/run",
                  "innerq_modes_4k": "reports/methods/innerq_modes_4k/run",
                  "compression_4k": "reports/methods/compression_4k/run",
                  "faults_meta_pg19_4k": "reports/faults/faults_meta_pg19_4k/run",
                  "evict_4k": "reports/evict/evict_4k/run",
                  "evict_8k": "reports/evict/evict_8k/run"}


def variant_cell(run: RunData, column: str, variant: str) -> str:
    """A hand-made table's cell as the raw records give it. ``column`` reads ``<what>
    (<suffix>)``: ``ppl`` the perplexity delta [95% CI], ``NIAH`` and ``RULER`` the method's
    accuracy, ``rungs 3+4`` their share of head-steps, ``T1`` Tier-1 over dense bytes,
    ``FP16 blk`` the blocks per step the integrity check served from their FP16 originals."""
    from certkv.eval.summary import certificate_summary

    what = column.rsplit(" (", 1)[0]
    if what in ("ppl", "NIAH", "RULER"):
        q = quality_delta(run, {"ppl": "perplexity"}.get(what, what.lower()), variant)
        return fmt_interval(q["delta"]) if what == "ppl" else fmt(q["method"])
    cert = certificate_summary(run.certificate_records(variant))
    if what == "rungs 3+4":
        return f"{100 * (cert['rung_rates'][3] + cert['rung_rates'][4]):.1f}%"
    if what == "FP16 blk":
        return fmt(cert.get("corrupted_blocks_per_step", 0.0), 0)
    assert what == "T1", column
    return f"{cert['tier1_over_dense']:.3f}"


def test_a_readme_variant_table_is_its_raw_records(monkeypatch):
    """Tables headed ``variants (<experiment>)``: each row names its variants with ``*`` for
    the column's suffix (``asym-*`` and ``ppl (naive)`` -> ``asym-naive``), each cell is
    :func:`variant_cell` of that variant (``-``: not run)."""
    monkeypatch.chdir(ROOT)
    checked, run, header = 0, None, None
    for path in ("reports/methods/README.md", "reports/faults/README.md",
                 "reports/evict/README.md"):
        for line in (ROOT / path).read_text().split("\n"):
            cells = row_cells(line)
            named = re.match(r"variants \((\w+)\)", cells[0]) if line.startswith("|") else None
            if named:
                run, header = RunData.load(VARIANT_TABLES[named.group(1)]), cells[1:]
                continue
            pattern = re.match(r"`([^`]*\*[^`]*)`", cells[0]) if line.startswith("|") else None
            if not line.startswith("|"):
                run = None
            if pattern is None or run is None:
                continue
            for column, cell in zip(header, cells[1:], strict=True):
                suffix = re.search(r"\(([^)]*)\)$", column).group(1)
                variant = pattern.group(1).replace("*", suffix)
                if cell == "-":
                    assert variant not in run.variants, variant
                    continue
                assert cell == variant_cell(run, column, variant), (path, variant, column)
                checked += 1
    assert checked >= 24, f"only {checked} cells found"
