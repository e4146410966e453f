"""The report's bar charts: RULER accuracy per subtask and the share of head-steps per rung.

Up to :data:`~certkv.report.look.MANY` methods, grouped (or stacked) bars in one panel; more,
small multiples: a panel per subtask (per rung), a row per method named on the y axis. Bars of
one method share its colour and hatch, and a marker in its style sits at each value, so a bar
of height zero still shows.
"""

from __future__ import annotations

import math

from certkv.eval import stats
from certkv.eval.summary import certificate_summary
from certkv.report.look import (
    MANY,
    _figure,
    grid,
    legend_right,
    method_hatch,
    method_rows,
    method_style,
    tag,
)
from certkv.report.tables import RunData

RUNGS = ("rung 0: fast path", "rung 1: K* expanded", "rung 2: values promoted",
         "rung 3: head dense", "rung 4: layer dense")
ERRORS = {"elinewidth": 0.8, "ecolor": "0.5", "capsize": 2}


def _value_marks(ax, run: RunData, variant: str, xs, ys) -> None:
    """``variant``'s marker at each value, unclipped: a bar of height zero stays visible."""
    look = method_style(run, variant)
    tag(ax.plot(xs, ys, linestyle="none", marker=look["marker"], color=look["color"],
                markeredgecolor="white", markeredgewidth=0.5, markersize=5, clip_on=False,
                zorder=3), variant)


def _bars(ax, run: RunData, variant: str, horizontal: bool, at, values, width: float,
          **kwargs):
    """``variant``'s bars (its colour and hatch, white edges) with its value markers."""
    look = method_style(run, variant)
    draw = ax.barh if horizontal else ax.bar
    bars = draw(at, values, width, color=look["color"], hatch=method_hatch(run, variant),
                edgecolor="white", linewidth=0.5, error_kw=ERRORS, **kwargs)
    tag(list(bars), variant)
    xs, ys = (values, at) if horizontal else (at, values)
    _value_marks(ax, run, variant, xs, ys)
    return bars


def _accuracy(run: RunData, records: list[dict], subtask: str, variant: str):
    """Mean score of ``variant`` on ``subtask`` and its 95% bootstrap CI over slices, as
    ``(estimate, below, above)``; None without records."""
    scores = [r["score"] for r in records if r["variant"] == variant and r["subtask"] == subtask]
    if not scores:
        return None
    iv = stats.bootstrap_mean(scores, seed=stats.seed_for(run.experiment, subtask, variant))
    if not iv.bounded:  # one slice: no interval
        return iv.estimate, 0.0, 0.0
    return iv.estimate, iv.estimate - iv.low, iv.high - iv.estimate


def ruler_subtasks_figure(run: RunData):
    """Accuracy per RULER subtask and method with 95% bootstrap CIs over slices: grouped bars
    for a few methods, else a panel per subtask with a row per method (dense's value a dotted
    line across the panel)."""
    records = [r for r in run.samples if r["task"] == "ruler"]
    if not records:
        return None
    subtasks = list(dict.fromkeys(r["subtask"] for r in records))
    found = {(s, v): _accuracy(run, records, s, v) for s in subtasks for v in run.variants}
    draw = _ruler_facets if len(run.variants) > MANY else _ruler_grouped
    fig = draw(run, subtasks, found)
    fig.suptitle(f"RULER, {run.label}: accuracy (95% CI)")
    return fig


def _ruler_grouped(run: RunData, subtasks: list[str], found: dict):
    """One panel: a group of bars per subtask, a bar per method, a legend on the right."""
    width = 0.8 / max(len(run.variants), 1)
    fig, axes = _figure(max(6.0, 1.1 * len(subtasks)) + 1.8, 3.8)
    ax = axes[0, 0]
    for k, v in enumerate(run.variants):
        mine = [found[s, v] or (math.nan, 0.0, 0.0) for s in subtasks]  # none: no bar
        xs = [i + (k - (len(run.variants) - 1) / 2) * width for i in range(len(subtasks))]
        _bars(ax, run, v, False, xs, [m[0] for m in mine], width,
              yerr=[[m[1] for m in mine], [m[2] for m in mine]], label=v)
    ax.set_xticks(range(len(subtasks)), subtasks, rotation=25, ha="right")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (95% CI)")
    legend_right(fig)
    return fig


def _ruler_facets(run: RunData, subtasks: list[str], found: dict):
    """A panel per subtask (rows of at most six, :func:`~certkv.report.look.grid`), a row per
    method named on the left."""
    rows, cols = grid(len(subtasks))
    names = list(run.variants)
    fig, axes = _figure(2.2 + 1.9 * cols, rows * (0.9 + 0.2 * len(names)), rows, cols,
                        sharex=True)
    for ax in axes.flat[len(subtasks):]:
        ax.set_visible(False)
    for i, (ax, s) in enumerate(zip(axes.flat, subtasks, strict=False)):
        for k, v in enumerate(names):
            if found[s, v] is not None:
                mean, below, above = found[s, v]
                _bars(ax, run, v, True, [k], [mean], 0.75, xerr=[[below], [above]])
        dense = found.get((s, run.reference)) if run.reference else None
        if dense is not None:
            ax.axvline(dense[0], color="black", linestyle=":", linewidth=0.9)
        method_rows(ax, names, labels=i % cols == 0)
        ax.set_xlim(-0.06, 1.06)
        ax.set_title(s, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("accuracy", fontsize=8)
    return fig


def rung_rates_figure(run: RunData):
    """The share of head-steps on each rung per method: stacked bars for a few methods (first
    on top), else a panel per rung with a row per method."""
    rates = {v: certificate_summary(run.certificate_records(v)) for v in run.variants}
    rates = {v: c["rung_rates"] for v, c in rates.items() if c.get("steps")}
    if not rates:
        return None
    fig = _rung_facets(run, rates) if len(rates) > MANY else _rungs_stacked(rates)
    fig.suptitle(f"Rungs, {run.label}")
    return fig


def _rungs_stacked(rates: dict[str, list[float]]):
    """One panel: a bar per method, its rungs stacked left to right, a legend of the rungs."""
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
    legend_right(fig)
    return fig


def _rung_facets(run: RunData, rates: dict[str, list[float]]):
    """A panel per rung, a row per method (named on the left), a marker at each share."""
    names = list(rates)
    fig, axes = _figure(2.2 + 1.9 * len(RUNGS), 0.9 + 0.2 * len(names), 1, len(RUNGS),
                        sharex=True)
    for rung, (ax, title) in enumerate(zip(axes[0], RUNGS, strict=True)):
        for k, v in enumerate(names):
            _bars(ax, run, v, True, [k], [100 * rates[v][rung]], 0.75)
        method_rows(ax, names, labels=rung == 0)
        ax.set_xlim(-6, 106)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("% of head-steps", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    return fig
