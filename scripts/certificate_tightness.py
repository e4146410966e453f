"""Measure how tight the certificate is: returned bound / actual error, per fast-path head.

Runs the synthetic LLaMA-like layer of ``certkv demo`` over seeds, contexts, key widths and
modes; the actual error is against FP64 attention on the FP16 originals. Writes
``reports/tightness.md`` and ``reports/tightness.json``.

    .venv/bin/python scripts/certificate_tightness.py [--seeds 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

from certkv.attention import CertifiedAttention
from certkv.demo import DemoLayer


def measure(seeds: int) -> list[dict]:
    rows = []
    for context in (512, 2048):
        for key_bits in (8, 4, 2):
            for mode in ("certified", "naive"):
                ratios, key_share, violations, heads, dense = [], [], 0, 0, 0
                for seed in range(seeds):
                    layer = DemoLayer.make(context, 8, 4, 128, seed)
                    store = layer.store(key_bits)
                    out, cert = CertifiedAttention(mode=mode)(layer.q, store)
                    err = (out.double() - layer.reference(store)).norm(dim=-1)
                    fast = cert.rung < 3
                    bound = cert.bound.double()
                    violations += int((fast & (err > bound * (1 + 1e-5) + 1e-5)).sum())
                    ok = fast & (err > 1e-6)
                    ratios.append(bound[ok] / err[ok])
                    key_share.append((cert.e_key.double() / bound.clamp_min(1e-30))[ok])
                    heads += int(fast.sum())
                    dense += int((~fast).sum())
                r = torch.cat(ratios)
                rows.append({
                    "context": context, "key_bits": key_bits, "mode": mode,
                    "fast_heads": heads, "dense_heads": dense, "violations": violations,
                    "ratio_median": float(r.median()) if r.numel() else float("nan"),
                    "ratio_p05": float(r.quantile(0.05)) if r.numel() else float("nan"),
                    "ratio_p95": float(r.quantile(0.95)) if r.numel() else float("nan"),
                    "e_key_share_median": float(torch.cat(key_share).median())
                    if r.numel() else float("nan"),
                })
    return rows


def write(rows: list[dict], command: str, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    machine = f"{platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}"
    lines = [
        "# Certificate tightness (bound / actual error)",
        "",
        f"Command: `{command}`  ",
        f"Machine: {machine}",
        "",
        "Synthetic LLaMA-like layer (32 query heads, 8 kv heads, d=128, outlier key channels, "
        "attention sink, needle), one decode step per seed, Table 2 policy, INT4 values g=16. "
        "Actual error: `||out - O_ref||_2` against FP64 attention on the FP16 originals. "
        "Ratios over fast-path heads (rungs 0-2) with actual error > 1e-6; "
        "`E_key share` = E_key / (E_key + E_val).",
        "",
        "| context | keys | mode | fast heads | dense heads | violations | bound/actual p05 "
        "| median | p95 | E_key share (median) |",
        "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['context']} | INT{r['key_bits']} | {r['mode']} | {r['fast_heads']} | "
            f"{r['dense_heads']} | {r['violations']} | {r['ratio_p05']:.2f} | "
            f"{r['ratio_median']:.2f} | {r['ratio_p95']:.2f} | {r['e_key_share_median']:.2f} |")
    tmp = out_dir / "tightness.md.tmp"
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out_dir / "tightness.md")
    tmp = out_dir / "tightness.json.tmp"
    tmp.write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2))
    tmp.replace(out_dir / "tightness.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("reports"))
    args = parser.parse_args()
    rows = measure(args.seeds)
    write(rows, "python " + " ".join(sys.argv), args.out)
    print((args.out / "tightness.md").read_text())


if __name__ == "__main__":
    main()
