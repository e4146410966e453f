"""The certificates figure: a row per certified method and a panel per term (E_key, E_val,
E_arith, and the returned bound beside the actual error where an audit measured it), each on a
log axis: a marker at the median per-step mean, a line from its 5th percentile to the largest
per-step maximum.

The actual error ``||out - O_ref||`` is read from ``error_step_mean`` / ``error_step_max``
where certificate records carry them (an audited run, ``audit=true``); a run that audited only
counts violations says so in the panel's title, as does a run with no audit at all.
"""

from __future__ import annotations

import statistics
import textwrap

from certkv.eval.summary import certificate_summary
from certkv.report.look import _figure, legend_right, log_axis, method_rows, method_style, tag
from certkv.report.tables import RunData

LABELS = {"e_key": "E_key", "e_val": "E_val", "e_arith": "E_arith", "bound": "bound"}
ERROR = "error"  # the audit's measured ||out - O_ref||, per step: error_step_mean / _max
SHIFT = 0.2  # the bound row and the error row of one method, apart


def step_values(run: RunData, variant: str, name: str, which: str = "mean") -> list[float]:
    """The per-step ``which`` (mean or max) of ``name`` over every certificate record of
    ``variant``."""
    return [x for c in run.certificate_records(variant) for x in c.get(f"{name}_step_{which}", [])]


def spread(run: RunData, variant: str, name: str) -> tuple[float, float, float] | None:
    """``(5th percentile, median)`` of the per-step means of ``name`` and the largest per-step
    maximum; None when the records carry none."""
    means = sorted(step_values(run, variant, name))
    if not means:
        return None
    top = max(step_values(run, variant, name, "max"), default=means[-1])
    return means[int(0.05 * (len(means) - 1))], statistics.median(means), max(top, means[-1])


def audit_note(run: RunData, certified: list[str]) -> str:
    """What the bound panel's title says of the actual error: drawn, audited but not recorded,
    or not measured."""
    if any(step_values(run, v, ERROR) for v in certified):
        return "bound vs actual error (audit)"
    summary = certificate_summary([c for v in certified for c in run.certificate_records(v)])
    if summary["audited"]:
        return (f"bound ({summary['violations']} head-steps over it; audit kept no error "
                "values)")
    return "bound (actual error not measured: audit=true)"


def _row(ax, run: RunData, variant: str, y: float, found, floor: float, label: str,
         hollow: bool = False) -> None:
    """One method's marker (median) and line (5th percentile to maximum) at height ``y``; a
    zero is drawn at ``floor``, the axis' left edge."""
    low, mid, top = (max(x, floor) for x in found)
    look = method_style(run, variant)
    fill = {"markerfacecolor": "white"} if hollow else {}
    tag(ax.plot([low, top], [y, y], color=look["color"], linewidth=1.2,
                linestyle=":" if hollow else "-", label=label), variant)
    tag(ax.plot([mid], [y], linestyle="none", marker=look["marker"], color=look["color"],
                markersize=6, clip_on=False, label=label, **fill), variant)
    tag(ax.plot([top], [y], linestyle="none", marker="|", color=look["color"], markersize=7,
                label=label), variant)
    if found[1] <= 0:  # zero at half the steps or more: drawn at the left edge, and said
        ax.annotate("0", (floor, y), xytext=(6, 0), textcoords="offset points", va="center",
                    fontsize=7, color=look["color"])


def _panel(ax, run: RunData, certified: list[str], name: str, found: dict) -> None:
    """One term's panel: a row per method (the actual error beside the bound), log x."""
    series = (name, ERROR) if name == "bound" else (name,)
    values = [x for v in certified for s in series for x in found[v, s] or () if x > 0]
    if not values:
        ax.set_xticks([])
        ax.text(0.5, 0.5, "0 for every method", transform=ax.transAxes, ha="center",
                fontsize=8, color="0.3")
        return
    log_axis(ax, min(values), max(values))
    floor = ax.get_xlim()[0]
    for k, v in enumerate(certified):
        error = found[v, ERROR] if name == "bound" else None
        shift = SHIFT if error else 0.0
        if found[v, name]:
            _row(ax, run, v, k - shift, found[v, name], floor, LABELS[name])
        if error:
            _row(ax, run, v, k + shift, error, floor, "actual error", hollow=True)


def certificate_distributions_figure(run: RunData):
    """A row per certified method, a panel per term of the certificate (log x): E_key, E_val,
    E_arith and the bound, with the audit's actual error beside the bound where recorded."""
    from matplotlib.lines import Line2D

    certified = [v for v in run.variants if certificate_summary(
        run.certificate_records(v)).get("steps")]
    if not certified:
        return None
    found = {(v, n): spread(run, v, n) for v in certified for n in (*LABELS, ERROR)}
    fig, axes = _figure(2.4 + 2.5 * len(LABELS), max(2.6, 1.4 + 0.3 * len(certified)), 1,
                        len(LABELS))
    for i, (ax, (name, label)) in enumerate(zip(axes[0], LABELS.items(), strict=True)):
        _panel(ax, run, certified, name, found)
        method_rows(ax, certified, labels=i == 0)
        title = audit_note(run, certified) if name == "bound" else label
        ax.set_title(textwrap.fill(title, 32), fontsize=9)
        ax.set_xlabel(f"{label}, per-step mean (log)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    grey = {"color": "0.3", "linestyle": "none"}
    handles = [Line2D([], [], marker="o", **grey), Line2D([], [], marker="|", **grey),
               Line2D([], [], color="0.3"),
               Line2D([], [], marker="o", markerfacecolor="white", color="0.3", linestyle=":")]
    labels = ["median per-step mean", "largest per-step max", "5th percentile to max",
              "actual error (audit)"]
    measured = any(found[v, ERROR] for v in certified)
    legend_right(fig, handles[:4 if measured else 3], labels[:4 if measured else 3])
    fig.suptitle(f"Certificates, {run.label}")
    return fig
