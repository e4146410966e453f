"""What every figure of the report shares: one look per method (colour, marker, line style and
bar hatch, pairwise distinct for the first 40 methods of a figure; the dense reference black),
the figure and its saving, outside legends, round log-axis ticks and point labels placed apart.

Each artist drawn for one method carries the method's name as its ``gid``
(:func:`tag`), so that tests (and readers of an SVG) can tell which method it shows.
"""

from __future__ import annotations

import math
from pathlib import Path

from certkv.report.tables import RunData, fmt_sci

# matplotlib's tab10, spelled out: a method's colour must not depend on rcParams
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22", "#17becf")
LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
HATCHES = ("", "//", "..", "xx", "\\\\", "o", "+")
REFERENCE = {"color": "black", "linestyle": "-", "marker": "*"}  # dense, wherever it is drawn
MANY = 8  # more methods than this: bar charts and line plots switch to small multiples


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(width: float, height: float, rows: int = 1, cols: int = 1, **kwargs):
    """A constrained-layout figure and its axes (room is made for outside legends)."""
    return _pyplot().subplots(rows, cols, figsize=(width, height), layout="constrained",
                              squeeze=False, **kwargs)


def _save(fig, path: Path) -> bool:
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    _pyplot().close(fig)
    return True


def _turn(k: int) -> int:
    """Markers, line styles and hatches advance once more each time the colours wrap, so that
    the ``k``-th and the ``k + 10 j``-th method (one colour) differ in all three for j < 4."""
    return k + k // len(PALETTE)


def style(k: int) -> dict:
    """The colour, line style and marker of the ``k``-th variant (or method) of a figure: the
    (colour, marker) pairs of the first 70 and the (colour, line style) pairs of the first 40
    are pairwise distinct."""
    turn = _turn(k)
    return {"color": PALETTE[k % len(PALETTE)], "linestyle": LINESTYLES[turn % len(LINESTYLES)],
            "marker": MARKERS[turn % len(MARKERS)]}


def hatch(k: int) -> str:
    """The bar hatch of the ``k``-th method: (colour, hatch) pairs distinct for the first 70."""
    return HATCHES[_turn(k) % len(HATCHES)]


def method_index(run: RunData, variant: str) -> int:
    """``variant``'s place among the run's methods, the dense reference left out (so every
    figure of a run gives a method the same look)."""
    return [v for v in run.variants if v != run.reference].index(variant)


def method_style(run: RunData, variant: str) -> dict:
    """:func:`style` of ``variant`` in ``run``; the dense reference is black."""
    return dict(REFERENCE) if variant == run.reference else style(method_index(run, variant))


def method_hatch(run: RunData, variant: str) -> str:
    """:func:`hatch` of ``variant`` in ``run`` (none for the dense reference)."""
    return "" if variant == run.reference else hatch(method_index(run, variant))


def tag(artists, variant: str):
    """Mark every artist of ``artists`` (one, a list or a matplotlib container) as drawn for
    ``variant``; returns them."""
    for artist in artists if hasattr(artists, "__iter__") else [artists]:
        artist.set_gid(variant)
    return artists


def legend_right(fig, handles=None, labels=None) -> None:
    """One legend for the whole figure, to the right of the axes (never over data or labels);
    without handles, those of every axes, each label once."""
    if handles is None:
        found = {}
        for ax in fig.axes:
            for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
                found.setdefault(label, handle)
        labels, handles = list(found), list(found.values())
    if handles:
        fig.legend(handles, labels, loc="outside right upper", fontsize=8, frameon=False)


def grid(panels: int, most: int = 6) -> tuple[int, int]:
    """Rows and columns for ``panels`` small multiples, at most ``most`` a row, the rows as
    even as they can be (7 panels: 2 rows of 4)."""
    rows = math.ceil(panels / most)
    return rows, math.ceil(panels / rows)


def method_rows(ax, names: list[str], labels: bool = True) -> None:
    """One row per method, the first on top, named on the y axis (``labels``) or not."""
    ax.set_yticks(range(len(names)), names if labels else [""] * len(names), fontsize=8)
    ax.set_ylim(len(names) - 0.4, -0.6)


TICK_STEPS = ((1,), (1, 2, 5), (1, 2, 3, 4, 5, 6, 7, 8, 9), tuple(k / 10 for k in range(10, 100)))


def log_ticks(low: float, high: float, most: int = 4) -> list[float]:
    """At most ``most`` (at least two) round ticks for a log axis over ``[low, high]``: powers
    of ten (every k-th when there are many), else 1-2-5, 1..9 or 1.0..9.9 multiples; when
    fewer than two fall inside, the finest of those that fits with the nearest ticks around
    the range."""
    decades = range(math.floor(math.log10(low)), math.ceil(math.log10(high)) + 1)
    powers = [10.0**e for e in decades if low <= 10.0**e <= high]
    if len(powers) > most:
        return powers[::math.ceil(len(powers) / most)]
    levels = [[float(f"{m * 10.0**e:.2g}") for e in decades for m in subs]
              for subs in TICK_STEPS]
    for ticks in levels:
        inside = [t for t in ticks if low <= t <= high]
        if 2 <= len(inside) <= most:
            return inside
    for ticks in reversed(levels):
        below = max((t for t in ticks if t <= low), default=low)
        above = min((t for t in ticks if t >= high), default=high)
        around = sorted({below, *[t for t in ticks if low <= t <= high], above})
        if len(around) <= most:
            return around
    return [low, high]


def tick_label(x: float) -> str:
    """``0.02``, ``5``, ``300`` in plain notation; smaller or larger ones as ``2e-3`` or
    ``1.8e-5`` (two digits only where the tick needs them)."""
    if 1e-2 <= abs(x) < 1e3:
        return f"{x:g}"
    return fmt_sci(x, 1) if float(fmt_sci(x, 1)) == x else fmt_sci(x, 2)


def log_axis(ax, low: float, high: float, most: int = 4) -> None:
    """A log x axis over ``[low, high]`` with the ticks of :func:`log_ticks` labelled and the
    minor ticks unlabelled (their labels overlap)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    if low == high:
        low, high = low / 1.5, high * 1.5
    ticks = log_ticks(low, high, most)
    left, right = math.log10(min(low, ticks[0])), math.log10(max(high, ticks[-1]))
    ax.set_xscale("log")
    ax.set_xlim(10 ** (left - 0.05 * (right - left)), 10 ** (right + 0.05 * (right - left)))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FixedFormatter([tick_label(t) for t in ticks]))
    ax.xaxis.set_minor_formatter(NullFormatter())


# label placement -------------------------------------------------------------------------

_DIRECTIONS = ((1, 0.3), (1, -1), (-1, 0.3), (-1, -1), (0, 1.4), (0, -1.4), (1, 1.2),
               (-1, 1.2), (1, -2), (-1, -2))
_LEADER = {"arrowstyle": "-", "lw": 0.5, "color": "0.55", "shrinkA": 0, "shrinkB": 3}


def _offsets(rings: int = 8, step: float = 5.0):
    """Candidate label offsets (points) around a point, nearest first, with their ring."""
    for ring in range(1, rings + 1):
        for dx, dy in _DIRECTIONS:
            yield ring, dx * step * ring, dy * step * ring


def _overlap(a, b) -> float:
    """The area two display boxes share (0 when apart)."""
    width = min(a.x1, b.x1) - max(a.x0, b.x0)
    height = min(a.y1, b.y1) - max(a.y0, b.y0)
    return max(width, 0.0) * max(height, 0.0)


def _outside(box, frame) -> float:
    """The area of ``box`` outside ``frame``."""
    return box.width * box.height - _overlap(box, frame)


def _text_box(note, dx: float, dy: float, renderer):
    """``note`` moved to offset ``(dx, dy)`` points (aligned away from its point) and its
    text's display box."""
    from matplotlib.text import Text

    note.set_position((dx, dy))
    note.set_horizontalalignment("left" if dx > 0 else "right" if dx < 0 else "center")
    note.update_positions(renderer)
    return Text.get_window_extent(note, renderer)


def place_labels(ax, points: list[tuple[float, float]], texts: list[str], fontsize: float = 7,
                 marker_pt: float = 7.0) -> list:
    """Label each of ``points`` (data coordinates) with its text, greedily, highest point
    first: each label takes the nearest offset whose box overlaps no label placed before it,
    no marker and nothing outside the axes (else the offset overlapping least); a label set
    further than the nearest ring gets a thin leader line to its point. Call it once the
    figure's layout and limits are final; returns the labels (annotations)."""
    from matplotlib.transforms import Bbox

    fig = ax.figure
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    frame = ax.get_window_extent(renderer)
    half = marker_pt * fig.dpi / 72 / 2
    shown = [ax.transData.transform(p) for p in points]
    taken = [Bbox.from_extents(x - half, y - half, x + half, y + half) for x, y in shown]
    placed = []
    for (x, y), text in sorted(zip(points, texts, strict=True), key=lambda p: -p[0][1]):
        note = ax.annotate(text, (x, y), xytext=(0, 0), textcoords="offset points",
                           fontsize=fontsize, va="center")
        best = None
        for ring, dx, dy in _offsets():
            box = _text_box(note, dx, dy, renderer)
            cost = sum(_overlap(box, t) for t in taken) + 10 * _outside(box, frame)
            if best is None or cost < best[0]:
                best = (cost, ring, dx, dy)
            if cost == 0:
                break
        _, ring, dx, dy = best
        taken.append(_text_box(note, dx, dy, renderer))
        if ring > 1:
            ax.annotate("", (x, y), xytext=(dx, dy), textcoords="offset points",
                        arrowprops=_LEADER)
        placed.append(note)
    return placed
