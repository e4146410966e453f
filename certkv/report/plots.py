"""The report's figures (matplotlib, written as PNG): RULER accuracy per subtask with CIs,
perplexity delta per window, NIAH accuracy per needle depth, certificate distributions, rung
rates. Each function takes a :class:`~certkv.report.tables.RunData` and a path, and returns
False when the run has nothing to plot."""

from __future__ import annotations

import statistics
from pathlib import Path

from certkv.eval import stats
from certkv.report.summary import certificate_summary
from certkv.report.tables import RunData


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> bool:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return True


def ruler_subtasks(run: RunData, path: Path) -> bool:
    """Grouped bars: accuracy per subtask and method, 95% bootstrap CI over slices."""
    records = [r for r in run.samples if r["task"] == "ruler"]
    if not records:
        return False
    plt = _pyplot()
    subtasks = list(dict.fromkeys(r["subtask"] for r in records))
    width = 0.8 / max(len(run.variants), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(subtasks)), 3.6))
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
        ax.bar(xs, means, width, yerr=errors, capsize=2, label=v)
    ax.set_xticks(range(len(subtasks)), subtasks, rotation=20)
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("accuracy (95% CI)")
    ax.set_title(f"RULER, {run.experiment}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def perplexity_deltas(run: RunData, path: Path) -> bool:
    """Per-window perplexity delta to dense, one row of points per method."""
    methods = [v for v in run.variants if v != run.reference]
    series = {v: [m["ppl"] - d["ppl"] for d, m in run.pairs("perplexity", v)] for v in methods}
    series = {v: s for v, s in series.items() if s}
    if not series:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 1 + 0.6 * len(series)))
    for k, deltas in enumerate(series.values()):
        ax.scatter(deltas, [k] * len(deltas), alpha=0.6)
        iv = stats.t_interval(deltas) if len(deltas) > 1 else None
        if iv:
            ax.errorbar(iv.estimate, k, xerr=[[iv.estimate - iv.low], [iv.high - iv.estimate]],
                        fmt="k|", capsize=4)
    ax.axvline(0, color="grey", lw=0.8)
    ax.set_yticks(range(len(series)), list(series))
    ax.set_xlabel("perplexity - dense perplexity, per window (mean, 95% t-CI)")
    ax.set_title(f"Perplexity, {run.experiment}")
    return _save(fig, path)


def niah_depths(run: RunData, path: Path) -> bool:
    """NIAH accuracy per needle depth (0.0-0.9) and method."""
    records = [r for r in run.samples if r["task"] == "niah"
               and len(r.get("retrieved") or []) > 1]  # the ten-needle protocol
    if not records:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for v in run.variants:
        mine = [r["retrieved"] for r in records if r["variant"] == v]
        if mine:
            depths = range(len(mine[0]))
            ax.plot([d / len(mine[0]) for d in depths],
                    [statistics.fmean(m[d] for m in mine) for d in depths], marker="o", label=v)
    ax.set_ylim(-0.05, 1.05)
    ax.set_xlabel("needle depth")
    ax.set_ylabel("fraction retrieved")
    ax.set_title(f"NIAH, {run.experiment}")
    ax.legend(fontsize=8)
    return _save(fig, path)


def certificate_distributions(run: RunData, path: Path) -> bool:
    """Histograms (log scale) of the per-step mean E_key, E_val and E_arith per method."""
    certified = [v for v in run.variants if certificate_summary(
        run.certificate_records(v)).get("steps")]
    if not certified:
        return False
    plt = _pyplot()
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(10, 3))
    for ax, name in zip(axes, ("e_key", "e_val", "e_arith"), strict=True):
        for v in certified:
            values = [x for c in run.certificate_records(v) for x in c.get(f"{name}_step_mean",
                                                                             []) if x > 0]
            if values:
                bins = np.logspace(np.log10(min(values)), np.log10(max(values)) + 1e-9, 30)
                ax.hist(values, bins=bins, histtype="step", label=v)
        ax.set_xscale("log")
        ax.set_title(f"{name} (per-step mean)")
    axes[0].legend(fontsize=7)
    return _save(fig, path)


def rung_rates(run: RunData, path: Path) -> bool:
    """Stacked bars: share of head-steps on each rung, per method."""
    rates = {v: certificate_summary(run.certificate_records(v)) for v in run.variants}
    rates = {v: c["rung_rates"] for v, c in rates.items() if c.get("steps")}
    if not rates:
        return False
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 0.8 + 0.5 * len(rates)))
    names = ["fast path", "K* expanded", "values promoted", "head dense", "layer dense"]
    left = [0.0] * len(rates)
    for rung, name in enumerate(names):
        widths = [100 * r[rung] for r in rates.values()]
        ax.barh(list(rates), widths, left=left, label=name)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.set_xlabel("% of head-steps")
    ax.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.35))
    ax.set_title(f"Rungs, {run.experiment}")
    return _save(fig, path)


FIGURES = {"ruler_subtasks": ruler_subtasks, "perplexity_deltas": perplexity_deltas,
           "niah_depths": niah_depths, "certificates": certificate_distributions,
           "rungs": rung_rates}
