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


def test_the_frontier_draws_each_tasks_quality_and_speed_per_budget_over_the_reads(
        tmp_path, monkeypatch):
    """Issue 56's frontier on the committed tasks run: a row per Tier-1 budget, a panel per task
    and one for the step time, over the share of the cache read in FP16 (every naive and
    certified variant a point); runs from before the count get none."""
    import certkv.report.look as look
    from certkv.report.evict import frontier

    older = RunData.load(REPORTS / "evict_4k" / "run")
    assert not frontier(older, tmp_path / "none.png")
    drawn = []
    monkeypatch.setattr(look, "_save", lambda fig, path: drawn.append(fig) or True)
    run = RunData.load(REPORTS / "tasks_4k" / "run")
    assert frontier(run, tmp_path / "frontier.png")
    titles = [ax.get_title() for ax in drawn[0].axes]
    assert titles == [f"{t}, Tier-1 {b}%" for b in (25, 10)
                      for t in ("perplexity", "niah", "ruler", "step time")]
    rows = evict_rows(run)
    for ax, budget in ((drawn[0].axes[3], 0.25), (drawn[0].axes[7], 0.1)):
        points = [(x, y) for line in ax.lines if line.get_linestyle() == "None"
                  for x, y in zip(line.get_xdata(), line.get_ydata(), strict=True)]
        mine = [r for r in rows if r["budget"] == budget]
        assert sorted(x for x, _ in points) == sorted(
            100 * r["cert"]["fp16_read_share"] for r in mine)
    assert all(r["cert"]["fp16_read_share"] == 0 for r in rows if r["mode"] == "naive")
    assert all(r["cert"]["fp16_read_share"] > 0.8 for r in rows if r["mode"] == "certified")
