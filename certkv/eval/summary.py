"""Summarise a run directory's records per variant (quality, certificate, memory, speed)."""

from __future__ import annotations

import statistics

import torch


def _quantiles(values: list[float]) -> dict:
    if not values:
        return {"median": 0.0, "p95": 0.0, "max": 0.0}
    x = torch.tensor(values, dtype=torch.float64)
    return {"median": float(x.median()), "p95": float(torch.quantile(x, 0.95)),
            "max": float(x.max())}


def certificate_summary(records: list[dict]) -> dict:
    """Table 11 convention: median / p95 of per-step means, max of per-step maxima; rung and
    check rates per head-step (Table 15)."""
    head_steps = sum(r["head_steps"] for r in records if r["steps"]) or 1
    steps = sum(r["steps"] for r in records) or 1
    out = {"steps": sum(r["steps"] for r in records)}
    for name in ("e_key", "e_val", "e_arith", "bound", "candidate_e_key", "candidate_e_val",
                 "paper_e_key", "paper_e_val"):
        means = [v for r in records for v in r.get(f"{name}_step_mean", [])]
        maxes = [v for r in records for v in r.get(f"{name}_step_max", [])]
        q = _quantiles(means)
        q["max"] = max(maxes, default=0.0)
        out[name] = q
    out["rung_rates"] = [sum(r[f"rung{k}"] for r in records) / head_steps for k in range(5)]
    for name in ("ranking_fail", "boundary_fail", "canary_fail"):
        out[f"{name}_rate"] = sum(r[name] for r in records) / head_steps
    for name in ("tol_escalated", "tol_dense"):  # ladder.bound_tol (absent in older runs)
        out[f"{name}_rate"] = sum(r.get(name, 0) for r in records) / head_steps
    out["value_promotions_per_step"] = sum(r["value_promotions"] for r in records) / steps
    out["k_star_mean"] = statistics.fmean(r["k_star_mean"] for r in records) if records else 0.0
    out["tier1_over_dense"] = statistics.fmean(r["tier1_over_dense"] for r in records) \
        if records else 0.0
    out["scratch_hit_rate"] = statistics.fmean(r["scratch_hit_rate"] for r in records) \
        if records else 0.0
    filled = [r["scratch_bytes"] / r["dense_bytes"] for r in records
              if "scratch_bytes" in r and r.get("dense_bytes")]  # absent in older runs
    out["scratch_over_dense"] = statistics.fmean(filled) if filled else None
    out["h2d_bytes_per_step"] = sum(r["h2d_bytes"] for r in records) / steps
    read = [(r["fp16_read_share"], r["steps"]) for r in records
            if "fp16_read_share" in r and r["steps"]]  # absent in older runs
    out["fp16_read_share"] = (sum(x * n for x, n in read) / sum(n for _, n in read)
                              if read else None)
    for name in ("corrected_words", "erased_words", "corrupted_blocks"):  # protect (seed 003)
        out[f"{name}_per_step"] = sum(r.get(f"{name}_per_step", 0.0) * r["steps"]
                                      for r in records) / steps
    out["page_in_steps_rate"] = sum(r.get("page_in_steps", 0) for r in records) / steps
    out["paged_evicted_per_step"] = sum(r.get("paged_evicted_blocks", 0)
                                        for r in records) / steps  # eviction (issue 23)
    out["targeted_per_step"] = sum(r.get("targeted_blocks", 0) for r in records) / steps
    out["mended_rate"] = sum(r.get("mended_heads", 0) for r in records) / head_steps
    out["violations"] = sum(r.get("violations", 0) for r in records)  # audit=true
    out["audited"] = any(r.get("audited", False) for r in records)
    out["uncovered_steps"] = sum(r.get("uncovered_steps", 0) for r in records)  # protect
    out["head_steps"] = head_steps
    return out


def summarize(samples: list[dict], certificates: list[dict], tasks, variants, cfg) -> dict:
    """Per-variant summary of a run; step-time ratios are against the run's dense variant."""
    per_variant = {}
    for variant in variants:
        mine = [s for s in samples if s["variant"] == variant.name]
        quality = {}
        for task in tasks:
            rows = [s for s in mine if s["task"] == task.name]
            if rows:
                quality[task.name] = task.aggregate(rows)
        ms = [s["ms_per_step"] for s in mine if s["decode_steps"]]
        per_variant[variant.name] = {
            "mode": variant.mode,
            "quantizer": (variant.hf_cache.label if variant.hf_cache is not None
                          else variant.quantizer.label),
            "tasks": quality,
            "certificate": certificate_summary(
                [c for c in certificates if c["variant"] == variant.name]),
            "ms_per_step": statistics.median(ms) if ms else 0.0,
        }
    dense = next((v for v in per_variant.values() if v["mode"] == "dense"), None)
    for entry in per_variant.values():
        base = dense["ms_per_step"] if dense else 0.0
        entry["step_time_vs_dense"] = entry["ms_per_step"] / base if base else None
    return {"experiment": cfg.experiment, "model": cfg.model.name, "variants": per_variant}


def table_rows(summary: dict, digits: int = 1) -> tuple[list[str], list[list[str]]]:
    """Header and one row of cells per variant (quality, certificate quantiles, rungs, K*,
    Tier-1 / dense bytes, step time), shared by the console and markdown reports."""
    variants = summary["variants"]
    tasks = sorted({t for v in variants.values() for t in v["tasks"]})
    head = ["variant", "KV", *tasks, "E_key med/p95/max", "E_val med/p95/max",
            "E_arith med/p95/max", "rungs % 0/1/2/3/4", "K* mean", "Tier-1/dense", "ms/step",
            "x dense"]

    def triple(q: dict) -> str:
        return "/".join(f"{q[k]:.{digits}e}" for k in ("median", "p95", "max"))

    rows = []
    for name, v in variants.items():
        cert, dense, ratio = v["certificate"], v["mode"] == "dense", v["step_time_vs_dense"]
        certified = cert.get("steps", 1) > 0  # the dense baseline runs the model's own SDPA
        rows.append([
            name, "model" if dense else v["quantizer"],
            *[_quality(v["tasks"].get(t)) for t in tasks],
            *([triple(cert["e_key"]), triple(cert["e_val"]), triple(cert["e_arith"]),
               "/".join(f"{100 * r:.0f}" for r in cert["rung_rates"]),
               f"{cert['k_star_mean']:.1f}"] if certified else ["-"] * 5),
            "1.000" if dense else f"{cert['tier1_over_dense']:.3f}" if certified else "-",
            f"{v['ms_per_step']:.0f}", "-" if ratio is None else f"{ratio:.2f}"])
    return head, rows


def _quality(entry: dict | None) -> str:
    if not entry:
        return "-"
    if "ppl" in entry:
        return f"ppl {entry['ppl']:.3f}"
    return f"acc {entry['accuracy']:.2f} (n={entry['trials']})"
