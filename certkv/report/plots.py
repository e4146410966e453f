"""The report's figures (matplotlib, written as PNG): RULER accuracy per subtask with CIs,
perplexity delta per window, NIAH accuracy per needle depth, certificate distributions, rung
rates, and the sweep aggregate.

Each ``*_figure`` function takes a :class:`~certkv.report.tables.RunData` and returns the
figure, or None when the run has nothing to plot; :data:`FIGURES` maps each figure's name to a
``draw(run, path) -> bool`` that writes it. A variant keeps its colour, line style and marker in
every figure, legends sit outside the axes, and log axes carry a few round, labelled ticks.
"""

from __future__ import annotations

import math
import statistics
import textwrap
from collections.abc import Callable
from pathlib import Path

from certkv.eval import stats
from certkv.report.summary import certificate_summary
from certkv.report.tables import RunData, fmt_sci

LINESTYLES = ("-", "--", ":", "-.")
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
RUNGS = ("rung 0: fast path", "rung 1: K* expanded", "rung 2: values promoted",
         "rung 3: head dense", "rung 4: layer dense")


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _figure(width: float, height: float, rows: int = 1, cols: int = 1):
    """A constrained-layout figure and its axes (room is made for outside legends)."""
    return _pyplot().subplots(rows, cols, figsize=(width, height), layout="constrained",
                              squeeze=False)


def _save(fig, path: Path) -> bool:
    fig.savefig(path, dpi=110, bbox_inches="tight", pad_inches=0.1)
    _pyplot().close(fig)
    return True


def style(k: int) -> dict:
    """The colour, line style and marker of the ``k``-th variant (or method) of a figure."""
    return {"color": f"C{k % 10}", "linestyle": LINESTYLES[k % len(LINESTYLES)],
            "marker": MARKERS[k % len(MARKERS)]}


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


def log_axis(ax, low: float, high: float) -> None:
    """A log x axis over ``[low, high]`` with the ticks of :func:`log_ticks` labelled and the
    minor ticks unlabelled (their labels overlap)."""
    from matplotlib.ticker import FixedFormatter, FixedLocator, NullFormatter

    if low == high:
        low, high = low / 1.5, high * 1.5
    ticks = log_ticks(low, high)
    left, right = math.log10(min(low, ticks[0])), math.log10(max(high, ticks[-1]))
    ax.set_xscale("log")
    ax.set_xlim(10 ** (left - 0.05 * (right - left)), 10 ** (right + 0.05 * (right - left)))
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FixedFormatter([tick_label(t) for t in ticks]))
    ax.xaxis.set_minor_formatter(NullFormatter())


def ruler_subtasks_figure(run: RunData):
    """Grouped bars: accuracy per subtask and method, 95% bootstrap CI over slices."""
    records = [r for r in run.samples if r["task"] == "ruler"]
    if not records:
        return None
    subtasks = list(dict.fromkeys(r["subtask"] for r in records))
    width = 0.8 / max(len(run.variants), 1)
    fig, axes = _figure(max(6.0, 1.1 * len(subtasks)) + 1.8, 3.8)
    ax = axes[0, 0]
    for k, v in enumerate(run.variants):
        means, errors = [], [[], []]
        for s in subtasks:
            scores = [r["score"] for r in records if r["variant"] == v and r["subtask"] == s]
            iv = stats.bootstrap_mean(scores, seed=stats.seed_for(run.experiment, s, v)) \
                if scores else None
            means.append(iv.estimate if iv else 0.0)
            errors[0].append(iv.estimate - iv.low if iv else 0.0)
            errors[1].append(iv.high - iv.estimate if iv else 0.0)
        xs = [i + (k - (len(run.variants) - 1) / 2) * width for i in range(len(subtasks))]
        ax.bar(xs, means, width, yerr=errors, capsize=2, label=v, color=style(k)["color"],
               error_kw={"elinewidth": 0.8, "ecolor": "0.25"})
    ax.set_xticks(range(len(subtasks)), subtasks, rotation=25, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (95% CI)")
    ax.set_title(f"RULER, {run.label}")
    legend_right(fig)
    return fig


def perplexity_deltas_figure(run: RunData):
    """Per-window perplexity delta to dense, one row of points per method."""
    methods = [v for v in run.variants if v != run.reference]
    series = {v: [m["ppl"] - d["ppl"] for d, m in run.pairs("perplexity", v)] for v in methods}
    series = {v: s for v, s in series.items() if s}
    if not series:
        return None
    fig, axes = _figure(6.5, max(2.2, 1.2 + 0.45 * len(series)))
    ax = axes[0, 0]
    for k, (v, deltas) in enumerate(series.items()):
        look = style(run.variants.index(v))
        ax.scatter(deltas, [k] * len(deltas), alpha=0.7, color=look["color"],
                   marker=look["marker"])
        iv = stats.t_interval(deltas) if len(deltas) > 1 else None
        if iv:
            ax.errorbar(iv.estimate, k, xerr=[[iv.estimate - iv.low], [iv.high - iv.estimate]],
                        fmt="k|", capsize=4)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(series)), list(series))
    ax.set_ylim(-0.6, len(series) - 0.4)
    ax.invert_yaxis()
    ax.set_xlabel("perplexity - dense perplexity, per window (mean, 95% t-CI)")
    ax.set_title(f"Perplexity, {run.label}")
    return fig


def niah_depths_figure(run: RunData):
    """NIAH accuracy per needle depth (0.0-0.9) and method; coincident lines stay visible
    (each method its line style and open marker of its own size)."""
    records = [r for r in run.samples if r["task"] == "niah"
               and len(r.get("retrieved") or []) > 1]  # the ten-needle protocol
    if not records:
        return None
    fig, axes = _figure(7.5, 3.4)
    ax = axes[0, 0]
    for k, v in enumerate(run.variants):
        mine = [r["retrieved"] for r in records if r["variant"] == v]
        if mine:
            depths = range(len(mine[0]))
            ax.plot([d / len(mine[0]) for d in depths],
                    [statistics.fmean(m[d] for m in mine) for d in depths], label=v,
                    **style(k), markerfacecolor="none", markersize=max(4, 10 - 1.5 * k))
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("fraction retrieved")
    ax.set_title(f"NIAH, {run.label}")
    legend_right(fig)
    return fig


def _bounds(run: RunData, variant: str, name: str) -> list[float]:
    """The per-step mean of bound ``name`` over every certificate record of ``variant``."""
    return [x for c in run.certificate_records(variant) for x in c.get(f"{name}_step_mean", [])]


def certificate_distributions_figure(run: RunData):
    """Histograms (log x) of the per-step mean E_key, E_val and E_arith per method; a method
    whose bound is zero at every step is named in the panel instead."""
    from matplotlib.lines import Line2D

    certified = [v for v in run.variants if certificate_summary(
        run.certificate_records(v)).get("steps")]
    if not certified:
        return None
    import numpy as np

    fig, axes = _figure(11.5, 3.3, cols=3)
    for ax, name in zip(axes[0], ("e_key", "e_val", "e_arith"), strict=True):
        values = {v: [x for x in _bounds(run, v, name) if x > 0] for v in certified}
        zero = [v for v in certified if _bounds(run, v, name) and not values[v]]
        found = [x for xs in values.values() for x in xs]
        if found:
            low, high = min(found), max(found)
            bins = np.logspace(math.log10(low), math.log10(high) + 1e-9, 30)
            for v, xs in values.items():
                if xs:
                    look = style(run.variants.index(v))
                    ax.hist(xs, bins=bins, histtype="step", color=look["color"],
                            linestyle=look["linestyle"], linewidth=1.3)
            log_axis(ax, low, high)
        if zero:  # named while they fit the panel, else counted (the table names them)
            note = ("all 0: " + ", ".join(zero) if len(zero) <= 2
                    else f"all 0: {len(zero)} methods (see the table)")
            ax.text(0.02, 0.97, textwrap.fill(note, 40), transform=ax.transAxes, va="top",
                    fontsize=7, color="0.3")
        label = {"e_key": "E_key", "e_val": "E_val", "e_arith": "E_arith"}[name]
        ax.set_title(label)
        ax.set_xlabel(f"{label}, per-step mean (log)")
    axes[0, 0].set_ylabel("decode steps")
    handles = [Line2D([], [], color=style(run.variants.index(v))["color"],
                      linestyle=style(run.variants.index(v))["linestyle"]) for v in certified]
    legend_right(fig, handles, certified)
    fig.suptitle(f"Certificates, {run.label}")
    return fig


def rung_rates_figure(run: RunData):
    """Stacked bars: share of head-steps on each rung, per method (first method on top)."""
    rates = {v: certificate_summary(run.certificate_records(v)) for v in run.variants}
    rates = {v: c["rung_rates"] for v, c in rates.items() if c.get("steps")}
    if not rates:
        return None
    fig, axes = _figure(7.5, 1.3 + 0.45 * len(rates))
    ax = axes[0, 0]
    left = [0.0] * len(rates)
    for rung, name in enumerate(RUNGS):
        widths = [100 * r[rung] for r in rates.values()]
        ax.barh(list(rates), widths, left=left, label=name, color=f"C{rung}")
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlim(0, 100)
    ax.invert_yaxis()
    ax.set_xlabel("% of head-steps")
    ax.set_title(f"Rungs, {run.label}")
    legend_right(fig)
    return fig


def _dodge(k: int, count: int, step: float = 0.06) -> float:
    """The x offset of the ``k``-th of ``count`` series, so coincident points stay visible."""
    return (k - (count - 1) / 2) * step


SWEEP_PANELS = {"ppl": "perplexity delta to dense (95% CI)",
                "accuracy": "accuracy delta to dense (95% CI)",
                "fallback": "fallback (rungs 3-4)", "k_star": "K* mean",
                "value_promotions": "value promotions per step",
                "tier1": "Tier-1 bytes / dense bytes", "ms": "decode step"}
SWEEP_UNITS = {"ppl": "perplexity - dense perplexity", "accuracy": "accuracy - dense accuracy",
               "fallback": "% of head-steps", "k_star": "FP16-key blocks",
               "value_promotions": "FP16-value blocks", "tier1": "ratio", "ms": "ms"}


def sweep_panels(name: str, rows: list[dict]):
    """The sweep aggregate against the swept point, one panel per quantity with its unit on
    the y axis: the perplexity delta and the accuracy delta (95% CIs) on panels of their own,
    fallback rate, K*, value promotions, Tier-1 bytes and step time. One colour and line
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
    panels = [*metrics, "fallback", "k_star", "value_promotions", "tier1", "ms"]
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
                scale = 100 if field == "fallback" else 1
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
        low = [d.estimate - d.low if math.isfinite(d.low) else 0.0 for _, d in sel]
        high = [d.high - d.estimate if math.isfinite(d.high) else 0.0 for _, d in sel]
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


ruler_subtasks = _saving(ruler_subtasks_figure)
perplexity_deltas = _saving(perplexity_deltas_figure)
niah_depths = _saving(niah_depths_figure)
certificate_distributions = _saving(certificate_distributions_figure)
rung_rates = _saving(rung_rates_figure)

FIGURES = {"ruler_subtasks": ruler_subtasks, "perplexity_deltas": perplexity_deltas,
           "niah_depths": niah_depths, "certificates": certificate_distributions,
           "rungs": rung_rates}
