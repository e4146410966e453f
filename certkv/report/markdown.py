"""Markdown rendering of a run summary (for reports/)."""

from __future__ import annotations


def _triple(q: dict) -> str:
    return f"{q['median']:.2e} / {q['p95']:.2e} / {q['max']:.2e}"


def summary_markdown(summary: dict, command: str, machine: str) -> str:
    """A markdown table with one row per variant, headed by the command and machine."""
    variants = summary["variants"]
    tasks = sorted({t for v in variants.values() for t in v["tasks"]})
    head = ["variant", "KV", *tasks, "E_key med / p95 / max", "E_val med / p95 / max",
            "rungs % 0/1/2/3/4", "K* mean", "Tier-1 / dense", "ms / step", "x dense"]
    lines = [f"# {summary['experiment']}: {summary['model']}", "",
             f"Command: `{command}`  ", f"Machine: {machine}", "",
             "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, v in variants.items():
        cert = v["certificate"]
        quality = []
        for t in tasks:
            q = v["tasks"].get(t, {})
            quality.append(f"ppl {q['ppl']:.3f}" if "ppl" in q else
                           f"acc {q['accuracy']:.2f} (n={q['trials']})" if q else "-")
        ratio = v["step_time_vs_dense"]
        dense = v["mode"] == "dense"
        lines.append("| " + " | ".join([
            name, "FP16" if dense else v["quantizer"], *quality, _triple(cert["e_key"]),
            _triple(cert["e_val"]), "/".join(f"{100 * r:.0f}" for r in cert["rung_rates"]),
            f"{cert['k_star_mean']:.1f}", "1.000" if dense else f"{cert['tier1_over_dense']:.3f}",
            f"{v['ms_per_step']:.0f}", "-" if ratio is None else f"{ratio:.2f}"]) + " |")
    return "\n".join(lines) + "\n"
