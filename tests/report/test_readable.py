"""Console tables and figures a new user can read (issue 19): at 100 columns, and when piped,
no line is wider than the console and no number is broken across lines; figures keep legends
off labels and data, tick labels apart, and perplexity and accuracy deltas on axes of their
own."""

from __future__ import annotations

import io
import itertools
import re
from collections import defaultdict

import pytest
from helpers.report import many_methods_run, ruler_run, write_run
from matplotlib.colors import to_rgba
from matplotlib.lines import Line2D
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from rich.console import Console
from typer.testing import CliRunner

import certkv.demo as demo
from certkv import bench_codecs
from certkv.cli import app
from certkv.report import certificates, look, plots
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


def test_a_scratch_sweep_figure_shows_the_hit_rate_and_host_to_device_bytes(tiny_data,
                                                                           tiny_run):
    """What the scratch size changes (where FP16 blocks come from) gets panels of its own;
    other knobs keep the common panels."""
    rows = point_rows(Point("scratch_key_blocks=0", tiny_run, tiny_data, None))
    rows += point_rows(Point("scratch_key_blocks=64", tiny_run, tiny_data, None))
    titles = {}
    for name in ("scratch", "vtol"):
        fig = plots.sweep_panels(name, rows)
        titles[name] = {ax.get_title(): ax for ax in fig.axes if ax.get_visible()}
        if name == "scratch":
            hit = titles[name]["scratch hit rate"]
            plotted = {round(float(y), 6) for line in hit.get_lines() for y in line.get_ydata()}
            assert round(100 * rows[0]["hit"], 6) in plotted and "%" in hit.get_ylabel()
        plots._pyplot().close(fig)
    extra = {"scratch hit rate", "host-to-device per step"}
    assert extra <= set(titles["scratch"]) and not extra & set(titles["vtol"])


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


# many methods (issue 52) -------------------------------------------------------------------

BLACK = to_rgba("black")


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """Dense and 24 methods on RULER, NIAH and perplexity, two of them audited."""
    return RunData.load(many_methods_run(tmp_path_factory.mktemp("many")))


def method_looks(fig) -> dict[str, set]:
    """Per method (the gid its artists carry), the looks of the artists that tell it apart:
    (colour, marker) of its marked lines, (colour, hatch) of its bars."""
    found = defaultdict(set)
    for artist in fig.findobj(lambda a: a.get_gid() is not None):
        if isinstance(artist, Line2D) and artist.get_marker() not in ("None", "", "|", None):
            found[artist.get_gid()].add(("line", to_rgba(artist.get_color()),
                                         artist.get_marker()))
        elif isinstance(artist, Rectangle):
            found[artist.get_gid()].add(("bar", to_rgba(artist.get_facecolor()),
                                         artist.get_hatch() or ""))
    return found


def marks(fig, method: str, ax=None) -> list:
    """The marked lines drawn for ``method`` (in ``ax``, or anywhere)."""
    return [a for a in (ax or fig).findobj(Line2D) if a.get_gid() == method
            and a.get_marker() not in ("None", "", "|", None)]


def test_the_first_forty_styles_are_pairwise_distinct_and_none_is_black():
    looks = [plots.style(k) | {"hatch": look.hatch(k)} for k in range(40)]
    for second in ("marker", "linestyle", "hatch"):
        pairs = {(s["color"], s[second]) for s in looks}
        assert len(pairs) == 40, second
    assert all(to_rgba(s["color"]) != BLACK for s in looks)
    assert look.REFERENCE["color"] == "black"


@pytest.mark.parametrize("name", list(plots.BUILDERS))
def test_every_figure_tells_25_methods_apart(many, name):
    """Each method's bars and markers have a (colour, hatch or marker) no other method's have;
    dense is black wherever drawn; bar charts and NIAH turn into a panel per subtask, rung or
    method, each method named on an axis or in a title."""
    fig = plots.BUILDERS[name](many)
    found = method_looks(fig)
    methods = [v for v in many.variants if v != "dense"]
    assert set(methods) <= set(found)
    assert all(found[v] for v in found)
    for a, b in itertools.combinations(found, 2):
        assert found[a].isdisjoint(found[b]), (name, a, b)
    assert all(look_[1] == BLACK for look_ in found.get("dense", ()))
    shown = [ax for ax in fig.axes if ax.get_visible()]
    named = {t.get_text() for ax in shown for t in ax.get_yticklabels()}
    named |= {ax.get_title() for ax in shown}
    assert set(methods) <= named  # labelled directly, no legend to decode
    panels = {"ruler_subtasks": 3, "niah_depths": 24, "rungs": 5, "certificates": 4}
    assert len(shown) == panels.get(name, 1)
    plots._pyplot().close(fig)


@pytest.mark.parametrize("methods", [3, 24])  # grouped bars; a panel per subtask
def test_a_zero_accuracy_still_shows_a_marker(tmp_path, methods):
    run = RunData.load(many_methods_run(tmp_path, methods=methods))
    fig = plots.ruler_subtasks_figure(run)
    fig.canvas.draw()
    (zero,) = [m for m in marks(fig, "method-01") if 0.0 in (*m.get_xdata(), *m.get_ydata())
               and (methods == 3 or m.axes.get_title() == "vt")]
    assert zero.get_visible() and zero.get_markersize() > 0 and not zero.get_clip_on()
    box = extent(fig, zero)
    assert box.width > 0 and box.height > 0 and fig.bbox.contains(box.x0, box.y0)
    plots._pyplot().close(fig)


def test_a_rung_no_head_step_took_still_shows_each_method(many):
    fig = plots.rung_rates_figure(many)
    rung4 = next(ax for ax in fig.axes if ax.get_title().startswith("rung 4"))
    for v in many.variants[1:]:
        (mark,) = marks(fig, v, rung4)
        assert list(mark.get_xdata()) == [0.0] and rung4.get_xlim()[0] < 0
    plots._pyplot().close(fig)


def test_certificates_show_the_bound_beside_the_actual_error(many, tmp_path):
    fig = plots.certificate_distributions_figure(many)
    bound = fig.axes[3]
    assert "actual error" in bound.get_title()

    def medians(v, label):
        return [float(m.get_xdata()[0]) for m in marks(fig, v, bound) if m.get_label() == label]

    for v in ("method-01", "method-03"):  # audited: both series, the error below its bound
        (b,), (e,) = medians(v, "bound"), medians(v, "actual error")
        assert e == pytest.approx(b / 10)
    assert medians("method-04", "actual error") == [] and medians("method-04", "bound")
    zero = fig.axes[0]  # method-02's E_key is 0 at every step: drawn at the edge, and said
    (mark,) = marks(fig, "method-02", zero)
    assert mark.get_xdata()[0] == zero.get_xlim()[0] and not mark.get_clip_on()
    assert "0" in [t.get_text() for t in zero.texts]
    plots._pyplot().close(fig)
    plain = RunData.load(ruler_run(tmp_path))
    fig = plots.certificate_distributions_figure(plain)
    title = " ".join(fig.axes[3].get_title().split())
    assert "actual error not measured: audit=true" in title
    assert not [m for m in fig.findobj(Line2D) if m.get_label() == "actual error"]
    plots._pyplot().close(fig)
    counted = [{**c, "audited": True, "violations": 3 * (i == 1)}
               for i, c in enumerate(plain.certificates)]
    counted = RunData.load(write_run(tmp_path / "counted", "counted", plain.samples,
                                     certs=counted))  # an audit that kept only its count
    assert certificates.audit_note(counted, ["certified"]) == (
        "bound (3 head-steps over it; audit kept no error values)")


def codec_records() -> dict:
    """The committed CPU codecs bench's points (two labels of it collided) and four more piled
    on one of them."""
    points = [("int8_int4", "quantized", 144, 0.54), ("kivi4", "quantized", 80, 0.55),
              ("kivi2", "quantized", 48, 0.6), ("tiers-rotation", "archive-rotation", 64, 15.6),
              ("tiers-kvquant", "archive-kvquant", 62.7, 4.5), ("innerq", "quantized", 58.5, 2.6),
              ("smartkv-b25", "2-bit", 36, 0.68), ("smartkv-b25", "3-bit", 52, 0.98),
              ("smartkv-b25", "4-bit", 68, 0.57), ("smartkv-b25", "8-bit", 132, 0.11)]
    points += [(f"pile-{i}", "quantized", 80 + i, 0.55) for i in range(4)]
    return {"precisions": [{"quantizer": q, "precision": p, "bytes_per_token": b,
                            "dequant_ms_per_1k": ms} for q, p, b, ms in points]}


def test_codec_labels_overlap_neither_each_other_nor_any_point():
    fig = bench_codecs.codecs_figure(codec_records())
    fig.canvas.draw()
    (ax,) = fig.axes
    labels = [t for t in ax.texts if t.get_text()]
    assert len(labels) == 14
    boxes = [Text.get_window_extent(t, fig.canvas.get_renderer()) for t in labels]
    assert not any(a.overlaps(b) for a, b in itertools.combinations(boxes, 2))
    points = [extent(fig, m) for m in ax.get_lines() if m.get_gid()]
    assert len(points) == 14
    assert not any(box.overlaps(p) for box in boxes for p in points)
    assert all(ax.bbox.contains(b.x0, b.y0) and ax.bbox.contains(b.x1, b.y1) for b in boxes)
    plots._pyplot().close(fig)
