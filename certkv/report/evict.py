"""Certified eviction (issue 23): quality against dense per eviction policy, Tier-1 budget and
mode (naive drops the evicted tokens, as kvpress does; certified bounds them from their
summaries and pages them in), with the traffic certification costs: the share of decode steps
that page an evicted block in, host-to-device bytes per step, Tier-1 bytes and step time.
Rendered for runs whose variants set ``evict``.
"""

from __future__ import annotations

from pathlib import Path

from certkv.eval.press import MODE as PRESS_MODE
from certkv.eval.press import KVPress
from certkv.eval.summary import certificate_summary
from certkv.report.layout import Table
from certkv.report.tables import RunData, fmt, fmt_interval, median_step_ms, quality_delta

_TASKS = ("perplexity", "niah", "ruler")


def evict_of(run: RunData, variant: str) -> dict:
    """The ``evict`` settings ``variant`` ran with: the run's, changed by the variant's (a
    variant naming another ``_target_`` replaces them)."""
    entry = run.variant_entry(variant)
    base, change = run.config.get("evict") or {}, entry.get("evict") or {}
    if "_target_" in change and change["_target_"] != base.get("_target_"):
        base = {}
    return {**base, **change}


def series_of(run: RunData, variant: str) -> str:
    """``naive``, ``certified`` or e.g. ``certified, keys2, targeted, bound_tol 0.05``: the
    mode, with the summary where it is not the default box, targeted page-in where it is on
    (``ladder.page_in_budget``, with its cap) and the ladder's bound tolerance (with ``tol
    page-in`` where ``ladder.tol_page_in`` reaches it), where the variant (or the run) sets
    them."""
    entry = run.variant_entry(variant)
    ladder = {**(run.config.get("ladder") or {}), **(entry.get("ladder") or {})}
    summary = evict_of(run, variant).get("summary", "box")
    parts = [summary] if summary != "box" else []
    budget = ladder.get("page_in_budget", 0)
    if budget != 0:
        parts.append("targeted" if budget is None else f"targeted {budget}")
    parts += [f"{k} {ladder[k]:g}" for k in ("bound_tol", "bound_rtol")
              if ladder.get(k) is not None]
    if ladder.get("tol_page_in") and (ladder.get("bound_tol") is not None
                                      or ladder.get("bound_rtol") is not None):
        parts.append("tol page-in")
    mode = run.modes[variant]
    return ", ".join([mode, *parts]) if mode == "certified" else mode


def press_of(run: RunData, variant: str) -> KVPress | None:
    """A ``mode: kvpress`` variant's press (None for any other variant)."""
    if run.modes.get(variant) != PRESS_MODE:
        return None
    return KVPress.from_config(run.variant_entry(variant).get("press"))


def press_policy(press: KVPress) -> str:
    """``SnapKVPress`` -> ``kvpress SnapKV`` (its options are the variant's, in its config)."""
    return f"kvpress {press.press.removesuffix('Press')}"


def policy_name(settings: dict) -> str:
    """``certkv.evict.SnapKVEviction`` -> ``snapkv`` (``none`` without a policy)."""
    target = settings.get("_target_", "")
    names = {"AgeEviction": "age", "StreamingEviction": "streaming",
             "HeavyHitterEviction": "heavy_hitter", "SnapKVEviction": "snapkv"}
    return names.get(target.rsplit(".", 1)[-1], "none")


def has_eviction(run: RunData) -> bool:
    return any(policy_name(evict_of(run, v)) != "none" or press_of(run, v) is not None
               for v in run.variants)


def evict_rows(run: RunData) -> list[dict]:
    """One dict per non-dense variant: policy, budget, mode, quality deltas and traffic."""
    rows = []
    dense_ms = median_step_ms(run, run.reference) if run.reference else float("nan")
    for v in run.variants:
        if v == run.reference:
            continue
        settings, press = evict_of(run, v), press_of(run, v)
        cert = certificate_summary(run.certificate_records(v))
        ms = median_step_ms(run, v) if press is None else float("nan")  # timed elsewhere
        rows.append({"variant": v, "mode": run.modes[v], "series": series_of(run, v),
                     "policy": policy_name(settings) if press is None else press_policy(press),
                     "budget": float(settings.get("budget", 1.0)) if press is None
                     else 1.0 - press.compression_ratio, "cert": cert,
                     "quality": {t: quality_delta(run, t, v) for t in _TASKS if t in run.tasks},
                     "x_dense": ms / dense_ms if dense_ms else float("nan")})
    return rows


def _scratch(cert: dict) -> str:
    share = cert.get("scratch_over_dense")
    return "-" if share is None else f"{share:.3f}"


def _read(cert: dict) -> str:
    share = cert.get("fp16_read_share")
    return "-" if share is None else f"{100 * share:.0f}"


def _delta(q: dict | None, digits: int) -> str:
    return "-" if q is None else fmt_interval(q["delta"], digits)


def evict_table(run: RunData) -> Table | None:
    """A row per policy, budget and mode: quality against dense with 95% CIs and what the
    certificate paged in."""
    evicting = _evicting(run)
    if not evicting:
        return None
    rows = []
    for r in evicting:
        cert, q = r["cert"], r["quality"]
        steps = cert.get("steps") or 0
        rows.append([r["variant"], r["policy"], f"{100 * r['budget']:.0f}%",
                     _delta(q.get("perplexity"), 2), _delta(q.get("niah"), 2),
                     _delta(q.get("ruler"), 2),
                     f"{100 * cert.get('page_in_steps_rate', 0.0):.0f}" if steps else "-",
                     f"{cert.get('paged_evicted_per_step', 0.0):.0f}" if steps else "-",
                     f"{cert.get('targeted_per_step', 0.0):.0f}" if steps else "-",
                     f"{100 * cert.get('mended_rate', 0.0):.1f}" if steps else "-",
                     f"{cert.get('h2d_bytes_per_step', 0.0) / 2**10:.0f}" if steps else "-",
                     _read(cert) if steps else "-",
                     f"{cert.get('tier1_over_dense', 0.0):.3f}", _scratch(cert),
                     fmt(r["x_dense"], 2)])
    dense = {t: next((r["quality"][t]["dense"] for r in evicting
                      if r["quality"].get(t)), None) for t in _TASKS}
    shown = ", ".join(f"{t} {fmt(x, 2)}" for t, x in dense.items() if x is not None)
    return Table(f"Eviction ({run.label}; issue 23)",
                 ["method", "policy", "budget", "ppl delta [95% CI]", "NIAH delta",
                  "RULER delta", "page-in %", "paged/step", "targeted", "mended %", "H2D KiB",
                  "FP16 %", "T1", "scr", "x dense"], rows,
                 f"Dense: {shown}. Quality: the method's paired delta to dense with its 95% CI "
                 "(values in the quality table). naive drops evicted tokens (kvpress); "
                 "certified reads their summaries in the bound and pages blocks in from Tier-2 "
                 "when it matters; kvpress: the press run by kvpress's own code on the same "
                 "prompts (its budget and T1: the share of prompt tokens kept, in FP16; timed in "
                 "its own process and venv, so no x dense).",
                 {"budget": "Tier-1 bytes of completed blocks / their dense FP16 bytes",
                  "page-in": "decode steps that read an evicted block from Tier-2",
                  "paged/step": "evicted (kv head, block) pairs paged in per decode step, all "
                                "layers",
                  "targeted": "(kv head, block) pairs read whole per decode step to mend a "
                              "failed boundary check (ladder.page_in_budget) or to bring a "
                              "head within its bound tolerance (ladder.tol_page_in)",
                  "mended": "head-steps whose boundary check held after that page-in (no "
                            "rung 3 for it)",
                  "H2D": "host-to-device KiB per step",
                  "FP16": "share of the quantized cache a head reads in FP16 per step, keys and "
                          "values, from Tier-2 or the scratch (every block on rungs 3-4; -: "
                          "not recorded)",
                  "T1": "Tier-1 bytes / dense bytes",
                  "scr": "FP16 blocks the scratch cache holds / dense bytes (on a CPU store, "
                         "what a device scratch would hold; device memory in use: T1 + scr; "
                         "-: not recorded)",
                  "x dense": "median step time / dense"}, keys=3)


def _evicting(run: RunData) -> list[dict]:
    """:func:`evict_rows` of the variants that evict (a certkv policy or a kvpress press):
    a run's other variants (quantizers alone, transformers' cache) have no budget to show."""
    return [r for r in evict_rows(run) if r["policy"] != "none"] if has_eviction(run) else []


def quality_vs_budget(run: RunData, path: Path) -> bool:
    """Left: perplexity against the budget per policy (naive dashed, certified solid, certified
    with a bound tolerance dash-dotted, kvpress dotted, dense dotted); right, where certified
    variants evict: their page-in traffic (host-to-device KiB per step). A run of one budget
    gets the frontier instead: :func:`frontier` where its records count the FP16 reads, else
    :func:`_frontier` over host-to-device bytes (runs from before the count)."""
    from certkv.report.look import _figure, _save, legend_right, style

    rows = [r for r in _evicting(run) if r["quality"].get("perplexity")]
    if not rows:
        return False
    if len({r["budget"] for r in rows}) == 1:  # one budget: the frontier against bytes read
        return False if _reads_recorded(rows) else _frontier(rows, path)
    paged = any(r["series"] not in ("naive", "kvpress") for r in rows)
    fig, axes = _figure(9.0 if paged else 4.5, 3.2, 1, 1 + paged)
    left, right = axes[0] if paged else (axes[0][0], None)
    for k, policy in enumerate(dict.fromkeys(r["policy"] for r in rows)):
        for series in dict.fromkeys(r["series"] for r in rows):
            mine = sorted((r for r in rows if r["policy"] == policy and r["series"] == series),
                          key=lambda r: r["budget"])
            if not mine:
                continue
            x = [100 * r["budget"] for r in mine]
            line = {"naive": "--", "certified": "-", "kvpress": ":"}.get(series, "-.")
            kw = {**style(k), "linestyle": line}
            label = policy if series == "kvpress" else f"{policy} {series}"
            left.plot(x, [r["quality"]["perplexity"]["method"] for r in mine], label=label, **kw)
            if right is not None and series not in ("naive", "kvpress"):  # certified page-in
                right.plot(x, [r["cert"].get("h2d_bytes_per_step", 0.0) / 2**10
                               for r in mine], label=f"{policy} {series}", **kw)
    _perplexity_axis(left, rows)
    if right is not None:
        right.set_ylim(bottom=0)
        right.set_ylabel("certified: host-to-device KiB / step")
    for ax, title in ((left, "quality"), (right, "page-in traffic"))[:1 + paged]:
        ax.set_xlabel("Tier-1 budget (% of dense bytes)", fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.invert_xaxis()  # tighter budgets to the right
    legend_right(fig)
    return _save(fig, path)


def _perplexity_axis(ax, rows: list[dict]) -> None:
    """Dense's perplexity as a dotted line, a log axis with plain labels."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.axhline(rows[0]["quality"]["perplexity"]["dense"], color="black", linestyle=":",
               linewidth=1, label="dense (FP16)")
    ax.set_yscale("log")
    plain = FuncFormatter(lambda y, _: f"{y:,.0f}" if y >= 1000 else f"{y:.4g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    # within a decade: label the minor ticks too; beyond, the decades alone (else they overlap)
    ax.yaxis.set_minor_formatter(plain if high < 10 * low else NullFormatter())
    ax.set_ylabel("perplexity (log)")


def _frontier(rows: list[dict], path: Path) -> bool:
    """One budget's frontier (issue 56): perplexity (left) and step time against dense (right)
    over the host-to-device KiB each method reads per step; a colour per series (mode, summary,
    targeted page-in, tolerance), a marker per policy."""
    from certkv.report.look import _figure, _save, legend_right

    fig, axes = _figure(9.0, 3.4, 1, 2)
    left, right = axes[0]
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    series = list(dict.fromkeys(r["series"] for r in rows))
    for r in sorted(rows, key=lambda r: series.index(r["series"])):  # a series at a time
        x = r["cert"].get("h2d_bytes_per_step", 0.0) / 2**10
        for ax, y in ((left, r["quality"]["perplexity"]["method"]), (right, r["x_dense"])):
            ax.plot([x], [y], **_point(r, series, policies))
    _legend_keys(left, series, policies)
    _perplexity_axis(left, rows)
    right.axhline(1.0, color="black", linestyle=":", linewidth=1)
    right.set_ylim(bottom=0)
    right.set_ylabel("step time / dense")
    for ax, title in ((left, "quality"), (right, "speed")):
        ax.set_xlabel("host-to-device KiB / step (all layers)", fontsize=8)
        ax.set_title(f"{title} at {100 * rows[0]['budget']:.0f}% of dense Tier-1 bytes",
                     fontsize=9)
    legend_right(fig)
    return _save(fig, path)


def _reads_recorded(rows: list[dict]) -> bool:
    """Whether every certified row counts what its steps read in FP16 (``fp16_read_share``,
    absent in runs from before the count)."""
    certified = [r for r in rows if r["mode"] == "certified"]
    return bool(certified) and all(r["cert"].get("fp16_read_share") is not None
                                   for r in certified)


def frontier(run: RunData, path: Path) -> bool:
    """Issue 56's frontier: each task's quality (a column per task, then step time against
    dense) against the share of the cache a step reads in FP16 (keys and values, from Tier-2
    or the scratch: what a certificate pays for, whatever the scratch hides from the
    host-to-device bytes), a row per Tier-1 budget; a colour per series (mode, summary,
    tolerance), a marker per policy, dense dotted. Drawn where the records count the reads."""
    from certkv.report.look import _figure, _save, legend_right

    rows = [r for r in _evicting(run) if r["mode"] in ("naive", "certified")]
    if not _reads_recorded(rows):
        return False
    tasks = [t for t in _TASKS if any(r["quality"].get(t) for r in rows)]
    budgets = sorted({r["budget"] for r in rows}, reverse=True)
    policies = list(dict.fromkeys(r["policy"] for r in rows))
    series = list(dict.fromkeys(r["series"] for r in rows))
    fig, axes = _figure(2.9 * (len(tasks) + 1), 2.5 * len(budgets), len(budgets), len(tasks) + 1)
    for i, budget in enumerate(budgets):
        for r in (r for r in rows if r["budget"] == budget):
            x = 100 * (r["cert"].get("fp16_read_share") or 0.0)
            ys = [r["quality"][t]["method"] if r["quality"].get(t) else None for t in tasks]
            for ax, y in zip(axes[i], [*ys, r["x_dense"]], strict=True):
                if y is not None:
                    ax.plot([x], [y], **_point(r, series, policies))
        for j, task in enumerate(tasks):
            _frontier_axis(axes[i][j], task, rows, f"{task}, Tier-1 {100 * budget:.0f}%")
        _frontier_axis(axes[i][-1], "speed", rows, f"step time, Tier-1 {100 * budget:.0f}%")
    _legend_keys(axes[0][0], series, policies)
    legend_right(fig)
    return _save(fig, path)


def _frontier_axis(ax, task: str, rows: list[dict], title: str) -> None:
    """One frontier panel's reference line (dense), scale, labels and title."""
    ax.set_xlim(-3, 103)
    ax.set_xlabel("FP16 read per step (% of the cache)", fontsize=8)
    ax.set_title(title, fontsize=9)
    if task == "speed":
        ax.axhline(1.0, color="black", linestyle=":", linewidth=1)
        ax.set_ylim(bottom=0)
        ax.set_ylabel("step time / dense", fontsize=8)
    elif task == "perplexity":
        _perplexity_axis(ax, [r for r in rows if r["quality"].get("perplexity")])
    else:
        dense = next(r["quality"][task]["dense"] for r in rows if r["quality"].get(task))
        ax.axhline(dense, color="black", linestyle=":", linewidth=1, label="dense (FP16)")
        ax.set_ylim(-0.05, 1.05)
        ax.set_ylabel(f"{task} score", fontsize=8)


def _point(row: dict, series: list[str], policies: list[str]) -> dict:
    """How a frontier draws ``row``'s point: its series' colour, its policy's marker."""
    from certkv.report.look import MARKERS, style

    return {"marker": MARKERS[policies.index(row["policy"]) % len(MARKERS)],
            "color": style(series.index(row["series"]))["color"], "linestyle": "none"}


def _legend_keys(ax, series: list[str], policies: list[str]) -> None:
    """The frontiers' legend keys on ``ax``: a coloured square per series, a grey marker per
    policy."""
    from certkv.report.look import MARKERS, style

    for k, name in enumerate(series):
        ax.plot([], [], color=style(k)["color"], marker="s", linestyle="none", label=name)
    for j, policy in enumerate(policies):
        ax.plot([], [], color="grey", marker=MARKERS[j % len(MARKERS)], linestyle="none",
                label=policy)
