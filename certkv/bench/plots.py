"""The figures of ``certkv bench attention`` and ``certkv bench launches``: milliseconds or
launches against context, one line style per shape, one colour per method."""

from __future__ import annotations

import itertools
import math
import statistics
from pathlib import Path

from certkv.bench.attention import LAUNCH_METHODS
from certkv.bench.measure import METHOD_COLORS, tokens

LAUNCH_TARGET = 6  # issue 55: Triton launches per certified layer step, nothing else
SHAPE_STYLES = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))  # (line style, marker)


def _figure(figsize: tuple[float, float]):
    """A headless matplotlib figure and axes (raises ImportError without matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=figsize)


BARS = "bars: 10th-90th percentile"  # of a case's runs; the tables give min and max


def percentiles(s: dict) -> tuple[float, float]:
    """The 10th and 90th percentiles of a timing's runs (:func:`~certkv.bench.measure.stats`;
    its min and max where it keeps no runs or one): one stalled step among a hundred, which
    the tables' max shows, does not stretch the figure's axis a hundredfold."""
    runs = s.get("runs") or []
    if len(runs) < 2:
        return s["min"], s["max"]
    cuts = statistics.quantiles(runs, n=10, method="inclusive")
    return cuts[0], cuts[-1]


def _series(ax, contexts: list[int], runs: list[dict], method: str, style: str,
            marker: str) -> None:
    """One method's median line, with error bars from the 10th to the 90th percentile of its
    runs (:func:`percentiles`) in the same colour."""
    med = [s["median"] for s in runs]
    spans = [percentiles(s) for s in runs]
    low = [max(0.0, m - lo) for m, (lo, _) in zip(med, spans, strict=True)]
    high = [max(0.0, hi - m) for m, (_, hi) in zip(med, spans, strict=True)]
    ax.errorbar(contexts, med, yerr=[low, high], linestyle=style, marker=marker, capsize=3,
                color=METHOD_COLORS[method])


def _context_axis(ax, contexts: list[int]) -> None:
    """Log-2 context axis with one labelled tick per measured context (512, 4K, ...)."""
    from matplotlib.ticker import NullLocator

    ticks = sorted(set(contexts))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [tokens(n) for n in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlabel("context (tokens)")
    ax.grid(alpha=0.3)


def _legends(ax, methods: list[str], shapes: list[tuple[str, str, str]]) -> None:
    """Outside the axes: colours = methods (bars: :data:`BARS`), and when there are
    several shapes, line style + marker = shape; every series is told apart."""
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=METHOD_COLORS[m], lw=2, label=m) for m in methods]
    first = ax.legend(handles=handles, title=f"method\n({BARS})", fontsize=8,
                      title_fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0))
    if len(shapes) > 1:
        ax.add_artist(first)
        handles = [Line2D([], [], color="0.3", linestyle=st, marker=mk, label=label)
                   for label, st, mk in shapes]
        ax.legend(handles=handles, title="shape", fontsize=8, title_fontsize=8,
                  handlelength=3.5, loc="lower left", bbox_to_anchor=(1.02, 0.0))


def plot_launches(records: list[dict], path: Path) -> None:
    """Per case (the store's precisions under it where the records name them), one stacked bar
    per method (named above it with its total): Triton launches,
    segment calls, eager launching operators; a tick at the CUDA launches the profiler counted
    (GPU only) and a dashed line at issue 55's target (:data:`LAUNCH_TARGET`; issue 24's was
    10)."""
    plt, fig, ax = _figure((8, 4.2))
    parts = (("kernels", "Triton launches"),
             ("segments", "segment calls (a compiled graph each: several CUDA kernels)"),
             ("eager_launches", "eager launching operators"))
    methods = list(records[0]["dispatch"]) if records else list(LAUNCH_METHODS)
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        x = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(records))]
        counts = [r["dispatch"][method] for r in records]
        bottom = [0] * len(records)
        for k, (key, label) in enumerate(parts):
            h = [c.get(key, 0) for c in counts]
            ax.bar(x, h, width * 0.9, bottom=bottom, color=f"C{k}",
                   label=label if i == 0 else None)
            bottom = [b + v for b, v in zip(bottom, h, strict=True)]
        for xi, total in zip(x, bottom, strict=True):
            ax.annotate(f"{method}: {total}", (xi, total), ha="center", va="bottom",
                        fontsize=7, rotation=90, xytext=(0, 2), textcoords="offset points")
        cuda = [c["launches"] for c in counts]
        if all(c is not None for c in cuda):
            ax.plot(x, cuda, "k_", markersize=14, label="CUDA launches" if i == 0 else None)
    ax.axhline(LAUNCH_TARGET, color="grey", linestyle="--", linewidth=1,
               label=f"issue 55's target ({LAUNCH_TARGET} launches, certified)")
    ticks = [_case_label(r) for r in records]
    ax.set_xticks(range(len(records)), ticks)
    ax.set_ylabel("launches per layer step (segments counted once)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    below = 0.1 + 0.07 * max((t.count("\n") for t in ticks), default=0)  # under the ticks
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -below), ncol=2)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def _case_label(record: dict) -> str:
    """A launch case's tick: its shape, and under it the precisions its store held (records of
    ``bench launches --quantizer``), so figures of different stores say which they show."""
    held = record.get("precisions")
    return record["short_label"] + (f"\n{', '.join(held)}" if held else "")


def plot_attention(records: list[dict], path: Path) -> None:
    """Median step time (:data:`BARS`) against context: colour = method, line style and marker
    = shape (head dim, GQA ratio)."""
    from matplotlib.ticker import FuncFormatter

    from certkv.report.plots import tick_label

    plt, fig, ax = _figure((8, 4.2))
    shapes = sorted({(r["case"]["head_dim"], r["case"]["group"]) for r in records})
    methods = list(records[0]["ms_stats"]) if records else []
    legend = []
    for (d, g), (style, marker) in zip(shapes, itertools.cycle(SHAPE_STYLES)):
        rows = [r for r in records if (r["case"]["head_dim"], r["case"]["group"]) == (d, g)]
        ctx = [r["case"]["context"] for r in rows]
        for method in methods:
            _series(ax, ctx, [r["ms_stats"][method] for r in rows], method, style, marker)
        legend.append((f"d={d} GQA {g}:1", style, marker))
    ax.set_yscale("log")
    # plain numbers (0.6, 2, 50 rather than 6e-01 or 5x10^1); minor ticks at 2, 3 and 5 times a
    # power of ten (more would overlap)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: tick_label(y)))
    ax.yaxis.set_minor_formatter(FuncFormatter(
        lambda y, _: tick_label(y) if round(y / 10 ** math.floor(math.log10(y))) in (2, 3, 5)
        else ""))
    ax.set_ylabel("ms per decode step (one layer)")
    _context_axis(ax, [r["case"]["context"] for r in records])
    _legends(ax, methods, legend)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
