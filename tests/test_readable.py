"""Console tables and figures a new user can read (issue 19): at 100 columns, and when piped,
no line is wider than the console and no number is broken across lines; figures keep legends
off labels and data, tick labels apart, and perplexity and accuracy deltas on axes of their
own."""

from __future__ import annotations

import io
import itertools
import re

import pytest
from helpers.report import ruler_run
from rich.console import Console
from typer.testing import CliRunner

import certkv.demo as demo
from certkv.cli import app
from certkv.report import plots
from certkv.report.document import build_report, print_report, write_report
from certkv.report.layout import WHOLE, Table, fit_columns, print_tables
from certkv.report.layout import make_console as _console
from certkv.report.sweep import Point, point_rows, sweep_table
from certkv.report.tables import RunData, fmt_sci

runner = CliRunner()
WIDTH = 100
# a number, or numbers joined by "/" (an a/b/c triple): never to be broken across lines
NUMBER = re.compile(r"[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?(?:/[+-]?\d+(?:\.\d+)?(?:e[+-]?\d+)?)*")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One short `certkv run +experiment=tiny` (perplexity and NIAH; dense, naive,
    certified)."""
    out = tmp_path_factory.mktemp("runs")
    result = runner.invoke(app, ["run", "+experiment=tiny", "task.perplexity.decode_tokens=4",
                                 "task.niah.trials=1", "task.niah.max_new_tokens=2",
                                 f"out_dir={out}"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (found,) = {p.parent for p in out.rglob("samples.jsonl")}
    return found


@pytest.fixture(scope="module")
def tiny_data(tiny_run):
    return RunData.load(tiny_run)


def recorded(width: int = WIDTH) -> Console:
    return Console(width=width, record=True, file=io.StringIO())


def assert_readable(text: str, tables: list[Table], width: int = WIDTH) -> None:
    """No line wider than ``width``; each cell of up to ``WHOLE`` characters on one line and
    every number (or ``a/b/c`` triple) of every cell unbroken in ``text``."""
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= width
    assert "…" not in text
    for table in tables:
        for cell in itertools.chain.from_iterable(table.rows):
            if len(cell) <= WHOLE:
                assert any(cell in line for line in lines), f"{cell!r} is broken"
            for number in NUMBER.findall(cell):
                assert number in text, f"{number!r} of {cell!r} is broken"


def test_every_report_table_fits_100_columns_without_breaking_a_number(tiny_run, tmp_path):
    ruler = ruler_run(tmp_path)
    for dirs in ([tiny_run], [tiny_run, ruler]):  # one run; two (a "run" column too)
        report = build_report(dirs)
        console = recorded()
        print_report(report, console)
        assert_readable(console.export_text(), report.tables)
    titles = " ".join(t.title for t in report.tables)
    for name in ("Quality", "Perplexity per window", "NIAH", "RULER", "Certificates",
                 "Ladder"):
        assert name in titles
    certificates = next(t for t in report.tables if t.title.startswith("Certificates"))
    assert re.fullmatch(r"(\d\.\de-?\d+|0)(/(\d\.\de-?\d+|0)){2}", certificates.rows[0][1])


def test_sweep_table_fits_100_columns(tiny_data, tiny_run):
    rows = point_rows(Point("v_tol=0.02", tiny_run, tiny_data, None))
    rows += point_rows(Point("v_tol=0.05", tiny_run, None, "not run (no point directory; see "
                             "the launcher's log for why this point never started)"))
    table = sweep_table("vtol", rows)
    console = recorded()
    print_tables([table], console)
    assert_readable(console.export_text(), [table])


def test_a_wide_table_splits_into_parts_that_repeat_its_keys():
    table = Table("wide", ["method", "task", *[f"column {i}" for i in range(12)]],
                  [["certified-paper", "perplexity", *["1.2e-3/4.5e-2/6.7e-1"] * 12]],
                  keys=2)
    parts = fit_columns(table, WIDTH)
    assert len(parts) > 1
    assert all(columns[:2] == [0, 1] for columns, _ in parts)
    assert sorted(c for columns, _ in parts for c in columns[2:]) == list(range(2, 14))
    assert all(sum(widths) + 2 * (len(widths) - 1) <= WIDTH for _, widths in parts)
    console = recorded()
    print_tables([table], console)
    text = console.export_text()
    assert_readable(text, [table])
    assert f"wide, part {len(parts)}/{len(parts)}" in text


def test_legends_explain_abbreviations_on_the_console_and_in_markdown(tiny_run, tmp_path):
    report = build_report([tiny_run])
    runtime = next(t for t in report.tables if t.title.startswith("Ladder"))
    assert {"K*", "VP", "T1"} <= set(runtime.legend)
    console = recorded()
    print_report(report, console)
    assert "VP: value promotions per step" in " ".join(console.export_text().split())
    readme = write_report(report, tmp_path / "out").read_text()
    assert "VP: value promotions per step" in readme


def test_piped_output_is_100_columns(tiny_run, tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert _console().width == WIDTH  # pytest's stdout is not a terminal
    monkeypatch.setenv("COLUMNS", "120")
    assert _console().width == 120
    monkeypatch.delenv("COLUMNS")
    result = runner.invoke(app, ["report", str(tiny_run), "--out", str(tmp_path / "rep")])
    assert result.exit_code == 0, result.output
    assert max(map(len, result.output.splitlines())) <= WIDTH
    assert_readable(result.output, build_report([tiny_run]).tables)


@pytest.mark.parametrize("console", ["width 100", "piped"])
def test_demo_tables_fit_100_columns(console, monkeypatch, capsys):
    monkeypatch.delenv("COLUMNS", raising=False)
    shown = []

    def capture(tables, out=None):
        shown.extend(tables)
        print_tables(tables, out)

    monkeypatch.setattr(demo, "print_tables", capture)
    out = recorded() if console == "width 100" else None
    rows = demo.run_demo(context=256, kv_heads=4, group=2, head_dim=32, console=out)
    text = out.export_text() if out else capsys.readouterr().out
    assert len(shown) == 2 and len(rows) == 6
    assert_readable(text, shown)
    assert fmt_sci(rows[0]["max_err"]) in text


# figures ---------------------------------------------------------------------------------


def extent(fig, artist):
    return artist.get_window_extent(fig.canvas.get_renderer())


def test_rung_legend_is_outside_the_axes_and_off_the_x_label(tiny_data):
    fig = plots.rung_rates_figure(tiny_data)
    fig.canvas.draw()
    (ax,) = fig.axes
    (legend,) = fig.legends
    box = extent(fig, legend)
    assert not box.overlaps(extent(fig, ax.xaxis.label))
    assert not box.overlaps(extent(fig, ax))
    plots._pyplot().close(fig)


def test_certificate_histograms_have_few_tick_labels_that_do_not_overlap(tiny_data):
    fig = plots.certificate_distributions_figure(tiny_data)
    fig.canvas.draw()
    for ax in fig.axes:
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert 2 <= len(labels) <= 5
        boxes = [extent(fig, t) for t in labels]
        assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
        assert not any(t.get_text() for t in ax.get_xticklabels(minor=True))
    (legend,) = fig.legends
    assert not any(extent(fig, legend).overlaps(extent(fig, ax)) for ax in fig.axes)
    plots._pyplot().close(fig)


@pytest.mark.parametrize("low, high", [(2.7e-4, 3.6e-4), (1.8e-5, 2.1e-5), (3.1e-3, 3.12e-3),
                                       (0.0165, 0.0205), (4e-4, 1.3), (1e-9, 1e3),
                                       (0.04, 0.65), (1.05e-3, 9.5e-3)])
def test_log_axes_label_a_few_round_ticks_apart(low, high):
    fig, axes = plots._figure(3.5, 3)
    ax = axes[0, 0]
    ax.plot([low, high], [0, 1])
    plots.log_axis(ax, low, high)
    fig.canvas.draw()
    labels = [t for t in ax.get_xticklabels() if t.get_text()]
    assert 2 <= len(labels) <= 4
    boxes = [extent(fig, t) for t in labels]
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    plots._pyplot().close(fig)


def test_sweep_figure_puts_perplexity_and_accuracy_deltas_on_their_own_axes(tiny_data,
                                                                            tiny_run):
    rows = point_rows(Point("v_tol=0.02", tiny_run, tiny_data, None))
    rows += point_rows(Point("v_tol=0.05", tiny_run, tiny_data, None))
    fig = plots.sweep_panels("vtol", rows)
    by_title = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
    ppl = by_title["perplexity delta to dense (95% CI)"]
    acc = by_title["accuracy delta to dense (95% CI)"]
    assert "perplexity" in ppl.get_ylabel() and "accuracy" in acc.get_ylabel()

    def plotted(ax):
        return {round(float(y), 9) for line in ax.get_lines() for y in line.get_ydata()}

    ppl_delta = rows[0]["quality"]["perplexity"]["delta"].estimate
    assert round(ppl_delta, 9) in plotted(ppl) and round(ppl_delta, 9) not in plotted(acc)
    assert all(ax.get_ylabel() for ax in by_title.values())  # every panel names its unit
    fig.canvas.draw()
    (legend,) = fig.legends
    assert not any(extent(fig, legend).overlaps(extent(fig, ax)) for ax in by_title.values())
    plots._pyplot().close(fig)


def test_a_failed_sweep_point_is_marked_on_the_figure(tiny_data, tiny_run):
    rows = point_rows(Point("v_tol=0.02", tiny_run, tiny_data, None))
    rows += point_rows(Point("v_tol=9", tiny_run, None, "v_tol=9 is too large."))
    fig = plots.sweep_panels("vtol", rows)
    ax = next(ax for ax in fig.axes if ax.get_visible())
    ticks = {t.get_text(): t.get_color() for t in ax.get_xticklabels()}
    assert ticks["v_tol=9 (failed)"] == "tab:red" and ticks["v_tol=0.02"] != "tab:red"
    plots._pyplot().close(fig)


def test_each_variant_keeps_one_distinct_style_in_every_figure(tiny_data, tmp_path):
    looks = [tuple(plots.style(k).values()) for k in range(len(tiny_data.variants))]
    assert len(set(looks)) == len(looks)
    for name, draw in plots.FIGURES.items():
        path = tmp_path / f"{name}.png"
        if draw(tiny_data, path):
            assert path.stat().st_size > 0
