"""The report's figures (matplotlib, written as PNG): RULER accuracy per subtask with CIs,
perplexity delta per window, NIAH accuracy per needle depth, certificate terms beside the
actual error, rung rates, and the sweep aggregate.

Each ``*_figure`` function takes a :class:`~certkv.report.tables.RunData` and returns the
figure, or None when the run has nothing to plot; :data:`BUILDERS` maps each figure's name to
it and :data:`FIGURES` to a ``draw(run, path) -> bool`` that writes it. A method keeps its
colour, marker, line style and hatch in every figure (:mod:`certkv.report.look`; dense black),
methods are named on the axes where a figure has a row or a panel per method, figures with
more than :data:`~certkv.report.look.MANY` methods turn into small multiples, legends sit
outside the axes, and log axes carry a few round, labelled ticks. The bar charts live in
:mod:`certkv.report.bars`, the certificates figure in :mod:`certkv.report.certificates`.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path

from certkv.report.bars import RUNGS, ruler_subtasks_figure, rung_rates_figure
from certkv.report.certificates import certificate_distributions_figure
from certkv.report.look import (
    MANY,
    MARKERS,
    REFERENCE,
    _figure,
    _pyplot,
    _save,
    grid,
    legend_right,
    log_axis,
    method_rows,
    method_style,
    style,
    tag,
    tick_label,
)
from certkv.report.tables import RunData, quality_delta

# what other modules and the tests take from here (defined in look, bars, certificates)
__all__ = ["FIGURES", "RUNGS", "_pyplot", "_save", "certificate_distributions_figure",
           "log_axis", "ruler_subtasks_figure", "rung_rates_figure", "style", "sweep_panels",
           "tick_label"]


def perplexity_deltas_figure(run: RunData):
    """Per-window perplexity delta to dense, a row of points per method (named on the left),
    with the delta of the pooled perplexities and its 95% t-CI over windows (the quality table's
    numbers)."""
    methods = [v for v in run.variants if v != run.reference]
    series = {v: [m["ppl"] - d["ppl"] for d, m in run.pairs("perplexity", v)] for v in methods}
    series = {v: s for v, s in series.items() if s}
    if not series:
        return None
    fig, axes = _figure(6.5, max(2.2, 1.2 + 0.3 * len(series)))
    ax = axes[0, 0]
    for k, (v, deltas) in enumerate(series.items()):
        look = method_style(run, v)
        tag(ax.plot(deltas, [k] * len(deltas), linestyle="none", alpha=0.75,
                    color=look["color"], marker=look["marker"]), v)
        iv = quality_delta(run, "perplexity", v)["delta"]
        if iv.bounded:
            ax.errorbar(iv.estimate, k, xerr=[[iv.estimate - iv.low], [iv.high - iv.estimate]],
                        fmt="k|", capsize=4)
        else:
            ax.plot(iv.estimate, k, "k|", markersize=10)
    ax.axvline(0, color="grey", lw=0.8)
    method_rows(ax, list(series))
    ax.set_xlabel("perplexity - dense perplexity: per window (points); pooled over windows "
                  "(bar, 95% t-CI)")
    ax.set_title(f"Perplexity, {run.label}")
    return fig


def _niah_curves(run: RunData) -> dict[str, tuple[list[float], list[float]]]:
    """Fraction retrieved per needle depth (0.0-0.9) per method, ten-needle records only."""
    records = [r for r in run.samples if r["task"] == "niah"
               and len(r.get("retrieved") or []) > 1]  # the ten-needle protocol
    curves = {}
    for v in run.variants:
        mine = [r["retrieved"] for r in records if r["variant"] == v]
        if mine:
            depths = range(len(mine[0]))
            curves[v] = ([d / len(mine[0]) for d in depths],
                         [statistics.fmean(m[d] for m in mine) for d in depths])
    return curves


def niah_depths_figure(run: RunData):
    """NIAH accuracy per needle depth (0.0-0.9) and method: one panel for a few methods (each
    its line style and open marker of its own size, so coincident lines stay visible), else a
    panel per method named in its title, dense drawn in each."""
    curves = _niah_curves(run)
    if not curves:
        return None
    fig = _niah_facets(run, curves) if len(curves) > MANY else _niah_one(run, curves)
    fig.suptitle(f"NIAH, {run.label}")
    return fig


def _niah_one(run: RunData, curves: dict):
    """Every method on one panel, a legend on the right."""
    fig, axes = _figure(7.5, 3.4)
    ax = axes[0, 0]
    for k, (v, (xs, ys)) in enumerate(curves.items()):
        tag(ax.plot(xs, ys, label=v, **method_style(run, v), markerfacecolor="none",
                    markersize=max(4, 10 - 1.5 * k)), v)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("fraction retrieved")
    legend_right(fig)
    return fig


def _niah_facets(run: RunData, curves: dict):
    """A panel per method (six a row), dense's curve in black in each."""
    methods = [v for v in curves if v != run.reference]
    rows, cols = grid(len(methods))
    fig, axes = _figure(2.1 * cols + 0.6, 1.75 * rows + 0.6, rows, cols, sharex=True,
                        sharey=True)
    for ax in axes.flat[len(methods):]:
        ax.set_visible(False)
    dense = curves.get(run.reference)
    for ax, v in zip(axes.flat, methods, strict=False):
        if dense:
            tag(ax.plot(*dense, **REFERENCE, linewidth=0.9, markersize=4, alpha=0.6),
                run.reference)
        tag(ax.plot(*curves[v], **method_style(run, v), markersize=4), v)
        ax.set_title(v, fontsize=8)
        ax.set_ylim(-0.05, 1.05)
        ax.tick_params(labelsize=7)
    fig.supxlabel("needle depth", fontsize=9)
    fig.supylabel("fraction retrieved" + (f" ({run.reference}: black)" if dense else ""),
                  fontsize=9)
    return fig


def _dodge(k: int, count: int, step: float = 0.06) -> float:
    """The x offset of the ``k``-th of ``count`` series, so coincident points stay visible."""
    return (k - (count - 1) / 2) * step


SWEEP_PANELS = {"ppl": "perplexity delta to dense (95% CI)",
                "accuracy": "accuracy delta to dense (95% CI)",
                "fallback": "fallback (rungs 3-4)", "k_star": "K* mean",
                "value_promotions": "value promotions per step",
                "tier1": "Tier-1 bytes / dense bytes", "ms": "decode step",
                "hit": "scratch hit rate", "h2d_mib": "host-to-device per step"}
SWEEP_UNITS = {"ppl": "perplexity - dense perplexity", "accuracy": "accuracy - dense accuracy",
               "fallback": "% of head-steps", "k_star": "FP16-key blocks",
               "value_promotions": "FP16-value blocks", "tier1": "ratio", "ms": "ms",
               "hit": "% of FP16 blocks read", "h2d_mib": "MiB"}
# the quantities a knob is about, shown beside the common panels (the scratch cache changes no
# result, only where FP16 blocks come from)
SWEEP_EXTRA = {"scratch": ("hit", "h2d_mib")}


def sweep_panels(name: str, rows: list[dict]):
    """The sweep aggregate against the swept point, one panel per quantity with its unit on
    the y axis: the perplexity delta and the accuracy delta (95% CIs) on panels of their own,
    fallback rate, K*, value promotions, Tier-1 bytes, the knob's own quantities
    (:data:`SWEEP_EXTRA`) and step time. One colour and line
    style per method, one marker per task; a failed point's tick says so in red; None when no
    point finished."""
    from matplotlib.lines import Line2D

    done = [r for r in rows if r["error"] is None]
    if not done:
        return None
    labels = list(dict.fromkeys(r["point"] for r in rows))
    failed = {r["point"] for r in rows} - {r["point"] for r in done}  # no result: a red tick
    methods = list(dict.fromkeys(r["method"] for r in done))
    tasks = list(dict.fromkeys(t for r in done for t in r["quality"]))
    metrics = dict.fromkeys(r["quality"][t]["metric"] for r in done for t in r["quality"])
    panels = [*metrics, "fallback", "k_star", "value_promotions", "tier1",
              *SWEEP_EXTRA.get(name, ()), "ms"]
    cols = 3 if len(panels) <= 6 else 4
    fig, axes = _figure(3.6 * cols + 1.8, 3.0 * math.ceil(len(panels) / cols),
                        rows=math.ceil(len(panels) / cols), cols=cols)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, field in zip(axes.flat, panels, strict=False):
        for k, method in enumerate(methods):
            mine = [r for r in done if r["method"] == method]
            xs = [labels.index(r["point"]) + _dodge(k, len(methods)) for r in mine]
            if field in metrics:
                _quality_series(ax, mine, xs, field, tasks, style(k))
            else:
                scale = 100 if field in ("fallback", "hit") else 1
                ax.plot(xs, [scale * r[field] for r in mine], color=style(k)["color"],
                        linestyle=style(k)["linestyle"], marker="o")
        if field in metrics:
            ax.axhline(0, color="grey", lw=0.8)
        ax.set_title(SWEEP_PANELS[field], fontsize=10)
        ax.set_ylabel(SWEEP_UNITS[field], fontsize=9)
        ax.set_xticks(range(len(labels)), [f"{x} (failed)" if x in failed else x
                                           for x in labels], rotation=20, ha="right", fontsize=8)
        for tick, label in zip(ax.get_xticklabels(), labels, strict=True):
            if label in failed:
                tick.set_color("tab:red")
        ax.set_xlim(-0.5, len(labels) - 0.5)
    handles = [Line2D([], [], color=style(k)["color"], linestyle=style(k)["linestyle"])
               for k in range(len(methods))]
    handles += [Line2D([], [], color="k", marker=MARKERS[j], linestyle="none")
                for j in range(len(tasks))]
    legend_right(fig, handles, methods + [f"task: {t}" for t in tasks])
    fig.suptitle(f"Sweep {name}")
    return fig


def _quality_series(ax, mine: list[dict], xs: list[float], metric: str, tasks: list[str],
                    look: dict) -> None:
    """One method's quality deltas of ``metric`` (ppl or accuracy) with their CIs, one marker
    per task (a CI one sample cannot give is left out)."""
    for j, task in enumerate(tasks):
        sel = [(x, r["quality"][task]["delta"]) for x, r in zip(xs, mine, strict=True)
               if task in r["quality"] and r["quality"][task]["metric"] == metric]
        if not sel:
            continue
        low = [d.estimate - d.low if d.bounded else 0.0 for _, d in sel]
        high = [d.high - d.estimate if d.bounded else 0.0 for _, d in sel]
        ax.errorbar([x for x, _ in sel], [d.estimate for _, d in sel],
                    yerr=[[max(e, 0.0) for e in low], [max(e, 0.0) for e in high]],
                    marker=MARKERS[j], capsize=3, color=look["color"],
                    linestyle=look["linestyle"])


def _saving(build: Callable) -> Callable[[RunData, Path], bool]:
    """``draw(run, path)``: build the figure and write it; False when there is nothing to
    plot."""
    def draw(run: RunData, path: Path) -> bool:
        fig = build(run)
        return fig is not None and _save(fig, path)

    draw.__doc__ = build.__doc__
    return draw


BUILDERS = {"ruler_subtasks": ruler_subtasks_figure, "perplexity_deltas": perplexity_deltas_figure,
            "niah_depths": niah_depths_figure, "certificates": certificate_distributions_figure,
            "rungs": rung_rates_figure}
"""Each figure's name and the function that builds it from a run (None: nothing to plot)."""
FIGURES = {name: _saving(build) for name, build in BUILDERS.items()}
"""Each figure's name and its ``draw(run, path) -> bool``."""
