"""The eviction report (certkv.report.evict) on the committed runs: each configuration its own
series, and a run of one budget drawn as its frontier against the bytes read."""

from __future__ import annotations

from pathlib import Path

from certkv.report.evict import evict_rows, quality_vs_budget, series_of
from certkv.report.tables import RunData

REPORTS = Path(__file__).resolve().parents[2] / "reports" / "evict"


def test_a_series_names_the_summary_targeted_page_in_and_tolerance():
    run = RunData.load(REPORTS / "summaries_4k" / "run")
    assert series_of(run, "age-naive") == "naive"
    assert series_of(run, "age-box") == "certified"
    assert series_of(run, "age-box-targeted") == "certified, targeted"
    assert series_of(run, "age-keys2-tol") == "certified, keys2, bound_tol 0.05"
    paged = RunData.load(REPORTS / "tol_4k" / "run")
    assert series_of(paged, "snapkv-keys2-tol-paged") == \
        "certified, keys2, bound_tol 0.05, tol page-in"
    assert series_of(paged, "certified-tol") == "certified, bound_tol 0.05"
    older = RunData.load(REPORTS / "evict_4k" / "run")  # runs from before the fields: as before
    assert series_of(older, "age-25-certified-tol") == "certified, bound_tol 0.05"


def test_one_budget_is_drawn_as_its_frontier(tmp_path):
    run = RunData.load(REPORTS / "summaries_4k" / "run")
    rows = evict_rows(run)
    assert len({r["budget"] for r in rows}) == 1
    assert all(r["cert"]["h2d_bytes_per_step"] > 0 for r in rows if r["mode"] == "certified")
    path = tmp_path / "frontier.png"
    assert quality_vs_budget(run, path) and path.stat().st_size > 10_000


def test_only_variants_that_evict_join_the_eviction_table_and_figure(tmp_path):
    """The methods run holds quantizers, transformers' cache and kvpress's presses: the table
    lists the presses alone (a quantizer has no eviction budget), and with no certified
    eviction the figure is its quality panel alone (no empty page-in panel)."""
    from PIL import Image

    from certkv.report.evict import evict_table

    run = RunData.load(REPORTS.parent / "methods" / "methods_4k" / "run")
    table = evict_table(run)
    assert [row[0] for row in table.rows] == [v for v in run.variants if v.startswith("kvpress")]
    path = tmp_path / "evict.png"
    assert quality_vs_budget(run, path)
    with Image.open(path) as image:
        width, height = image.size
    assert width < 2 * height  # one panel and its legend (two panels: about 3x as wide)
