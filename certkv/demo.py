"""One certified decode step on synthetic LLaMA-like data, dense vs naive vs certified.

The layer mimics what makes KV quantization hard: a few key channels with 10-60x larger range
(post-RoPE outliers), an attention sink at token 0, and one "needle" token the queries of some
heads look for. Every mode runs on the same tiered store; errors are measured against FP64
attention on the FP16 originals.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch
from rich.console import Console

from certkv import ChannelAffineKeyCodec, Ladder, TieredKVStore
from certkv.attention import CertifiedAttention
from certkv.certify.certificate import RUNG_NAMES, Certificate
from certkv.errors import ConfigError, require
from certkv.kernels.reference import exact_attention
from certkv.report.layout import make_console, print_tables
from certkv.report.tables import Table, fmt_sci


@dataclass
class DemoLayer:
    """Synthetic keys/values ``[Hkv, N, d]`` and one decode query ``[Hq, d]``."""

    k: torch.Tensor
    v: torch.Tensor
    q: torch.Tensor

    @classmethod
    def make(cls, context: int, kv_heads: int, group: int, head_dim: int, seed: int) -> DemoLayer:
        gen = torch.Generator().manual_seed(seed)
        k = torch.randn(kv_heads, context, head_dim, generator=gen)
        outliers = torch.randperm(head_dim, generator=gen)[:4]
        k[..., outliers] *= 10 + 50 * torch.rand(4, generator=gen)
        k[:, 0] *= 3  # attention sink
        v = torch.randn(kv_heads, context, head_dim, generator=gen)
        needle = int(context * 0.37)
        q = 0.3 * torch.randn(kv_heads * group, head_dim, generator=gen)
        seekers = torch.arange(0, kv_heads * group, 2)  # every other head looks for the needle
        q[seekers] += 3.0 * k[seekers // group, needle] / k[seekers // group, needle].norm()
        q = q * head_dim**0.25
        return cls(k, v, q)

    def store(self, key_bits: int, block_size: int = 16, value_group: int = 16) -> TieredKVStore:
        hkv, _, d = self.k.shape
        store = TieredKVStore(hkv, d, block_size=block_size, value_group=value_group,
                              key_codec=ChannelAffineKeyCodec(bits=key_bits))
        store.append(self.k, self.v)
        return store

    def reference(self, store: TieredKVStore) -> torch.Tensor:
        """FP64 attention on the store's FP16 originals -> ``[Hq, d]``."""
        return exact_attention(self.q, store)


def timed_step(attn, q, store, repeats: int = 3):
    """Run one step ``repeats`` times; returns output, certificate and median milliseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out, cert = attn(q, store)
        times.append(1e3 * (time.perf_counter() - start))
    return out, cert, statistics.median(times)


def _quantiles(x: torch.Tensor) -> str:
    """Median and max over the heads: ``8.9e-4/2.2e-2``."""
    x = x.double()
    return f"{fmt_sci(float(x.median()))}/{fmt_sci(float(x.max()))}"


def check_dims(head_dim: int, value_group: int) -> None:
    """The demo's head dimension must hold its codes: 2-bit keys pack 4 per byte and INT4
    values are grouped by ``value_group``; a :class:`ConfigError` suggests the nearest sizes
    that work with the other argument, in the command's flag syntax."""
    step = math.lcm(4, value_group)
    up = step * -(-head_dim // step)
    groups = [g for g in (16, 8, 4, 2, 1) if head_dim % g == 0 and head_dim % 4 == 0]
    other = f" or --value-group {groups[0]}" if groups else ""
    require(head_dim % step == 0, ConfigError,
            f"--head-dim {head_dim} must be a multiple of {step} (4 two-bit key codes per byte, "
            f"INT4 value groups of --value-group {value_group}); use --head-dim {up}{other}.")


def run_demo(context: int = 2048, kv_heads: int = 8, group: int = 4, head_dim: int = 128,
             seed: int = 0, console: Console | None = None, value_group: int = 16,
             bound_tol: float | None = None) -> list[dict]:
    """Print the comparison table and the certified step's per-head certificate (fitted to the
    console's width: 100 columns when piped); return rows. ``bound_tol`` adds a certified row
    with that guarantee (``Ladder(bound_tol=...)``: every head within it or dense)."""
    check_dims(head_dim, value_group)
    console = console or make_console()
    methods = [("dense", CertifiedAttention(mode="dense")),
               ("naive", CertifiedAttention(mode="naive")),
               ("certified", CertifiedAttention())]
    if bound_tol is not None:
        methods.append((f"tol {bound_tol:g}",
                        CertifiedAttention(ladder=Ladder(bound_tol=bound_tol))))
    layer = DemoLayer.make(context, kv_heads, group, head_dim, seed)
    table = Table(f"One decode step: {kv_heads * group} query heads ({kv_heads} kv), "
                  f"d={head_dim}, {context} cached tokens",
                  ["keys", "mode", "max err", "E_key med/max", "E_val med/max",
                   "E_arith med/max", "max bound", "rungs 0/1/2/3/4", "K*", "T1", "ms"], [],
                  "max err: largest error of any head against FP64 attention; max bound: the "
                  "largest returned bound, ok if every head's error is within its own; rungs: "
                  "heads on each rung; "
                  "tol X: certified with ladder.bound_tol=X (every head's bound <= X, or the "
                  "head is dense).",
                  {"med/max": "median and max over the query heads",
                   "K*": "mean FP16-key blocks", "T1": "Tier-1 bytes / dense bytes"}, keys=2)
    rows, shown = [], None
    for key_bits in (8, 2):
        store = layer.store(key_bits, value_group=value_group)
        ref = layer.reference(store)
        for mode, attention in methods:
            out, cert, ms = timed_step(attention, layer.q, store)
            err = (out.double() - ref).norm(dim=-1)
            holds = bool((err <= cert.bound.double()).all())  # every head, dense ones too
            rungs = "/".join(str(int((cert.rung == r).sum())) for r in RUNG_NAMES)
            ratio = store.tier1_bytes() / store.dense_bytes() if mode != "dense" else 1.0
            table.rows.append([f"INT{key_bits}", mode, fmt_sci(float(err.max())),
                               _quantiles(cert.e_key), _quantiles(cert.e_val),
                               _quantiles(cert.e_arith),
                               f"{fmt_sci(float(cert.bound.max()))} "
                               f"{'ok' if holds else 'VIOLATED'}",
                               rungs, f"{float(cert.k_star.double().mean()):.1f}",
                               f"{ratio:.3f}", f"{ms:.1f}"])
            rows.append({"key_bits": key_bits, "mode": mode, "max_err": float(err.max()),
                         "bound_holds": holds, "ms": ms, **cert.summary()})
            if key_bits == 8 and mode == "certified":
                shown = (cert, err)
    tables = [table] if shown is None else [table, certificate_table(*shown, max_heads=8)]
    print_tables(tables, console)
    return rows


def certificate_table(cert: Certificate, err: torch.Tensor, max_heads: int = 8) -> Table:
    """Per-head certificate of one step (INT8 keys, INT4 values, Table 2 policy)."""
    shown = min(max_heads, cert.num_heads)
    rows = [[str(h), RUNG_NAMES[int(cert.rung[h])], str(int(cert.k_star[h])),
             fmt_sci(float(cert.tail_mass[h])), f"{float(cert.delta[h]):.3f}",
             fmt_sci(float(cert.e_key[h])), fmt_sci(float(cert.e_val[h])),
             fmt_sci(float(cert.e_arith[h])), fmt_sci(float(err[h])),
             "ok" if cert.ranking_ok[h] else "FAIL", "ok" if cert.boundary_ok[h] else "FAIL"]
            for h in range(shown)]
    return Table(f"Certificate of the certified INT8/INT4 step (first {shown} of "
                 f"{cert.num_heads} query heads)",
                 ["head", "rung", "K*", "tail mass", "Delta", "E_key", "E_val", "E_arith",
                  "actual err", "ranking", "boundary"], rows,
                 "actual err: the head's error against FP64 attention, within E_key + E_val + "
                 "E_arith; ranking, boundary: the ladder's checks.",
                 {"K*": "FP16-key blocks"})
