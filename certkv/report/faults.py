"""Storage faults in the seed's form (seed 003, Tables 3-7): perplexity per protection mode and
bit-flip rate, its delta to dense (FP16), what the code corrected and erased, the blocks the
integrity check served from FP16, bits per stored value, NIAH, and the head-steps whose error
exceeded their certificate (``audit=true``). Rendered for runs whose variants set ``protect``.
"""

from __future__ import annotations

from pathlib import Path

from certkv.eval.summary import certificate_summary
from certkv.quant.protect.protection import bits_per_value
from certkv.report.layout import Table
from certkv.report.tables import RunData, fmt, fmt_interval, fmt_sci, quality_delta


def protect_of(run: RunData, variant: str) -> dict:
    """The ``protect`` settings ``variant`` ran with: the run's, changed by the variant's."""
    entry = run.variant_entry(variant)
    base, change = run.config.get("protect") or {}, entry.get("protect") or {}
    faults = {**(base.get("faults") or {}), **(change.get("faults") or {})}
    return {"code": "none", "erasure": "zero", "integrity": False,
            **base, **change, "faults": faults}


def mode_label(protect: dict) -> str:
    """``hamming84+interp`` etc.: the code and its erasure rule."""
    code = protect.get("code", "none")
    return f"{code}+interp" if protect.get("erasure") == "interp" else code


def has_faults(run: RunData) -> bool:
    """Whether any variant of ``run`` sets a code, the integrity check or faults."""
    for v in run.variants:
        p = protect_of(run, v)
        if p["code"] != "none" or p["integrity"] or p["faults"].get("p", 0):
            return True
    return False


def planned(run: RunData, variant: str) -> bool:
    """Whether ``variant`` is in the run's config (a variant dropped from the plan keeps its
    records, but its protection settings are no longer recorded)."""
    return bool(run.variant_entry(variant))


def fault_rows(run: RunData) -> list[dict]:
    """One dict per non-dense variant of the plan: its protection, fault rate, quality and
    counters."""
    rows = []
    for v in run.variants:
        if v == run.reference or not planned(run, v):
            continue
        protect = protect_of(run, v)
        cert = certificate_summary(run.certificate_records(v))
        ppl, niah = quality_delta(run, "perplexity", v), quality_delta(run, "niah", v)
        rows.append({"variant": v, "mode": run.modes[v], "code": mode_label(protect),
                     "p": float(protect["faults"].get("p", 0.0)),
                     "check": bool(protect["integrity"]), "ppl": ppl, "niah": niah,
                     "metadata": bool(protect["faults"].get("metadata", False)),
                     "cert": cert, "bits": bits_per_value(protect["code"])})
    return rows


def faults_table(run: RunData) -> Table | None:
    """The seed's tables in one: a row per protection mode, rate and method."""
    if not has_faults(run):
        return None
    found, rows = fault_rows(run), []
    for r in found:
        cert, ppl, niah = r["cert"], r["ppl"], r["niah"]
        audited = cert.get("audited")
        violations = (f"{cert['violations']}/{cert['head_steps']}" if audited else "-")
        if cert.get("uncovered_steps"):
            violations += " no cert."
        rows.append([r["variant"], r["code"], fmt_sci(r["p"], 1) if r["p"] else "0",
                     "all" if r["metadata"] and r["p"] else "codes" if r["p"] else "-",
                     "yes" if r["check"] else "no",
                     "-" if ppl is None else fmt(ppl["method"], 2),
                     "-" if ppl is None else fmt_interval(ppl["delta"], 2),
                     "-" if niah is None else fmt(niah["method"], 2),
                     fmt(cert.get("corrected_words_per_step", 0.0), 0),
                     fmt(cert.get("erased_words_per_step", 0.0), 0),
                     fmt(cert.get("corrupted_blocks_per_step", 0.0), 0),
                     f"{r['bits']:g}", violations])
    dense = next((r["ppl"]["dense"] for r in found if r["ppl"]), None)
    dropped = [v for v in run.variants if v != run.reference and not planned(run, v)]
    left_out = (" Left out, no longer in the run's plan (their records stay; config.yaml no "
                f"longer says how they were protected): {', '.join(dropped)}." if dropped else "")
    return Table(f"Storage faults ({run.label}; seed 003 Tables 3-7)",
                 ["method", "code", "p", "faulted", "check", "ppl", "delta [95% CI]", "NIAH",
                  "corr.", "erased", "FP16 blk", "bits", "over bound"], rows,
                 f"Dense (FP16) perplexity {fmt(dense, 2) if dense else '-'}. Persistent bit "
                 "flips at rate p, drawn once per written block. Counters per decode step over "
                 "every layer: words the code corrected, words it erased (detected, not "
                 "fixable), blocks the integrity check served from their FP16 originals. over "
                 "bound: audited head-steps whose error against FP64 attention on the originals "
                 "exceeded the returned bound; no cert.: faults hit bits no integrity check "
                 "covers, so the returned bounds certify nothing (the certificate's "
                 "faults_covered)." + left_out,
                 {"p": "bit-flip probability", "faulted": "the bits flipped: codes, the stored "
                  "code words (parity included); all, every stored bit (code words, scales, "
                  "offsets, the blocks' annotations and the integrity check: "
                  "faults.metadata=true)", "check": "per-block integrity check",
                  "delta": "perplexity - dense on the same windows",
                  "bits": "stored bits per 4-bit value", "FP16 blk": "corrupted blocks read "
                  "from Tier-2 per step"}, keys=5)


def perplexity_vs_rate(run: RunData, path: Path) -> bool:
    """Perplexity against the flip rate, one line per protection mode (its colour, line style
    and open marker of its own size), a panel per method (naive, certified, certified with the
    integrity check); dense as a dotted line."""
    from matplotlib.ticker import FuncFormatter

    from certkv.report.look import _figure, _save, legend_right, log_axis, style

    rows = [r for r in fault_rows(run) if r["ppl"] is not None] if has_faults(run) else []
    if not rows:
        return False
    panels = [("naive", False), ("certified", False), ("certified", True)]
    fig, axes = _figure(10.5, 3.2, 1, 3)
    codes = list(dict.fromkeys(r["code"] for r in rows))
    rates = sorted({r["p"] for r in rows if r["p"] > 0})
    floor = rates[0] / 10 if rates else 1e-5  # where p = 0 is drawn on the log axis
    dense = rows[0]["ppl"]["dense"]
    values = [dense, *(r["ppl"]["method"] for r in rows)]
    span = (min(values) / 1.02, max(values) * 1.02)  # one y range: panels compare at a glance
    plain = FuncFormatter(lambda y, _: f"{y:.4g}")
    for ax, (mode, check) in zip(axes[0], panels, strict=True):
        for k, code in enumerate(codes):
            mine = sorted((r["p"] or floor, r["ppl"]["method"]) for r in rows
                          if r["code"] == code and r["mode"] == mode
                          and (r["check"] == check or r["p"] == 0))
            if mine:  # open markers of decreasing size: coincident lines stay visible
                ax.plot(*zip(*mine, strict=True), label=code, **style(k),
                        markerfacecolor="none", markersize=max(4, 9 - 1.2 * k))
        ax.axhline(dense, color="black", linestyle=":", linewidth=1, label="dense (FP16)")
        ax.set_yscale("log")
        ax.set_ylim(*span)
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        log_axis(ax, floor, rates[-1] if rates else 1.0)
        ax.set_title(mode + (" + integrity check" if check else ""), fontsize=9)
        ax.set_xlabel(f"bit-flip rate p (p = 0 at {fmt_sci(floor, 1)})", fontsize=8)
    axes[0][0].set_ylabel("perplexity (log)")
    legend_right(fig)
    return _save(fig, path)
