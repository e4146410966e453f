"""``certkv bench``: decode-step timings, dense vs naive vs certified, in one process.

* ``attention``: one decode step of one layer for each context length, head dim and GQA ratio:
  dense FP16 SDPA on a resident FP16 cache (the production baseline), naive quantized, and
  certified with each phase timed; achieved GB/s (bytes each method must read / time), and
  memory per tier.
* ``decode``: one whole-model decode step (random weights: timing does not depend on them) for
  a model config at several contexts, dense vs certified, with the phase breakdown of the
  paper's Table 16 (attention phases summed over layers; the rest is non-attention work).

Timing: warm-up, then the median of ``repeats`` runs (CUDA-synchronised on GPU). Results go to
``reports/bench/`` as markdown + JSON + a plot, with the device, versions and command.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from certkv.attention import CertifiedAttention
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.files import write_atomic
from certkv.kernels.reference import dense_attention
from certkv.provenance import source_commit
from certkv.timing import PhaseTimer, _sync

# Peak DRAM bandwidth (GB/s) of GPUs this project is measured on; None elsewhere.
PEAK_GBPS = {"H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H200": 4800.0}


def device_info() -> dict:
    """Device name, peak bandwidth if known, and library versions."""
    import transformers

    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    else:
        name, peak = f"CPU ({platform.machine()}, {os.cpu_count()} cores)", None
    return {"device": name, "peak_gbps": peak, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "commit": source_commit()}


def timed(fn, repeats: int, warmup: int = 2) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


@dataclass
class AttentionCase:
    """One layer's decode step: ``context`` tokens, ``kv_heads`` x ``group`` query heads."""

    context: int
    head_dim: int
    kv_heads: int
    group: int
    seed: int = 0

    @property
    def label(self) -> str:
        return (f"N={self.context} d={self.head_dim} GQA {self.group}:1 "
                f"({self.kv_heads * self.group}q/{self.kv_heads}kv)")

    def build(self, device: torch.device):
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.kv_heads, self.context, self.head_dim)
        k = torch.randn(shape, generator=gen)
        k[..., : max(1, self.head_dim // 32)] *= 20  # outlier channels
        v = torch.randn(shape, generator=gen)
        store = TieredKVStore(self.kv_heads, self.head_dim, device=device,
                              decoded_mirror=device.type == "cpu")
        store.append(k.to(device), v.to(device))
        q = torch.randn(self.kv_heads * self.group, self.head_dim, generator=gen) * 2
        return store, q.to(device), k.to(device, torch.float16), v.to(device, torch.float16)


def bench_attention_case(case: AttentionCase, device: torch.device, repeats: int,
                         compile: bool | str | None = None) -> dict:
    """Time dense / naive / certified for one case; returns a JSON-able record (``compile``:
    as :class:`CertifiedAttention`; the first timed warm-up calls absorb compilation).

    Whole-step times are taken without the phase timer (its per-phase synchronisation would
    inflate them); the phase breakdown comes from separate timed runs.
    """
    store, q, k16, v16 = case.build(device)
    scaling = case.head_dim ** -0.5
    # the baseline: dense decode straight from a resident cache in the device's compute dtype
    # (FP16 on GPU; FP32 on CPU, which has no fast FP16 math), converted once, outside timing
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    qd, kd, vd = q.to(dtype), k16.to(dtype), v16.to(dtype)
    dense_ms = timed(lambda: dense_attention(qd, kd, vd, scaling), repeats)
    naive = CertifiedAttention(mode="naive", compile=compile)
    naive_ms = timed(lambda: naive(q, store), repeats)
    certified = CertifiedAttention(compile=compile)
    scratch = ScratchCache()
    cert_ms = timed(lambda: certified(q, store, scratch=scratch), repeats)
    timer = certified.timer = PhaseTimer()
    runs = 3
    for _ in range(runs):
        _, cert = certified(q, store, scratch=scratch)
    phases = {k: v / runs for k, v in timer.ms.items()}
    times = {"dense": dense_ms, "naive": naive_ms, "certified": cert_ms}
    traffic = _bytes_read(store, cert, case)
    step = sum(phases.values()) or 1.0
    return {"case": case.__dict__, "label": case.label, "ms": times, "dense_dtype": str(dtype),
            "ratio_vs_dense": {m: t / dense_ms for m, t in times.items()},
            "gbps": {m: traffic[m] / times[m] / 1e6 for m in times},
            "phases_ms": phases, "k_star_mean": float(cert.k_star.float().mean()),
            "phase2": {"ms": phases.get("phase2", 0.0),
                       "ratio_vs_dense": phases.get("phase2", 0.0) / dense_ms,
                       "gbps": traffic["phase2"] / max(phases.get("phase2", 0.0), 1e-9) / 1e6},
            "checks_share": phases.get("checks", 0.0) / step,
            "memory_bytes": {"dense": store.dense_bytes(), "tier1": store.tier1_bytes(),
                             "tier2": store.tier2_bytes(), "annotations":
                             store.annotation_bytes(), "workspace": store.workspace_bytes()}}


def _bytes_read(store: TieredKVStore, cert, case: AttentionCase) -> dict[str, int]:
    """Bytes each method must move per step: dense reads the FP16 cache; naive and certified
    read Tier-1 (certified also its promoted FP16 blocks); Phase 2 alone reads the INT4 values,
    the Phase-1 logits (FP32, one per query head and token) and the promoted FP16 blocks."""
    block_bytes = store.block_size * case.head_dim * 2
    promoted = int(cert.k_star.sum()) * block_bytes + cert.value_promotions * block_bytes
    logits = 4 * case.kv_heads * case.group * store.num_tokens
    values = store.value_blocks()
    value_bytes = sum(t.numel() * t.element_size() for t in values.values())
    return {"dense": store.dense_bytes(), "naive": store.tier1_bytes(),
            "certified": store.tier1_bytes() + promoted,
            "phase2": value_bytes + logits + promoted}


def default_cases(device: torch.device) -> list[AttentionCase]:
    """GPU: 4K-128K at d=64 and 128, GQA 4:1 and 3:1; CPU: small sizes so it always runs."""
    contexts = [4096, 16384, 32768, 65536, 131072] if device.type == "cuda" else [1024, 4096]
    shapes = [(128, 8, 4), (64, 3, 3)]
    return [AttentionCase(n, d, hkv, g) for n in contexts for d, hkv, g in shapes]


@dataclass
class BenchReport:
    """Writes ``<out>/<name>.json``, ``.md`` and ``.png``."""

    name: str
    command: str
    out_dir: Path = Path("reports/bench")
    info: dict = field(default_factory=device_info)

    def write(self, records: list[dict], table: list[str], plot) -> Path:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        payload = {"command": self.command, **self.info, "records": records}
        write_atomic(self.out_dir / f"{self.name}.json", json.dumps(payload, indent=2) + "\n")
        head = [f"# certkv bench {self.name}", "", f"Command: `{self.command}`  ",
                f"Commit: `{self.info['commit']}`  ",
                f"Device: {self.info['device']} (peak {self.info['peak_gbps'] or 'n/a'} GB/s); "
                f"torch {self.info['torch']}, transformers {self.info['transformers']}", "",
                f"![{self.name}]({self.name}.png)", ""]
        try:
            plot(self.out_dir / f"{self.name}.png")
        except ImportError:  # matplotlib is absent on some lent GPU machines: keep the numbers
            head[-2] = "(plot skipped: matplotlib is not installed)"
        write_atomic(self.out_dir / f"{self.name}.md", "\n".join(head + table) + "\n")
        return self.out_dir / f"{self.name}.md"


def attention_table(records: list[dict], peak_gbps: float | None = None) -> list[str]:
    """Markdown rows per case, then the issue's targets checked where they apply (GPU)."""
    lines = ["| case | dense ms | naive ms | certified ms | cert / dense | phase 2 / dense | "
             "phase 2 GB/s | checks % of step | K* mean | dense GB/s | certified GB/s | "
             "phases ms (layout/phase1/select/page_in/phase2/certificate/checks/fallback) | "
             "Tier-1 / dense |",
             "|" + " --- |" * 13]
    order = ("layout", "phase1", "select", "page_in", "phase2", "certificate", "checks",
             "fallback")
    for r in records:
        phases = "/".join(f"{r['phases_ms'].get(p, 0):.2f}" for p in order)
        mem = r["memory_bytes"]
        p2 = r["phase2"]
        p2_gbps = f"{p2['gbps']:.1f}" + (f" ({100 * p2['gbps'] / peak_gbps:.0f}% of peak)"
                                         if peak_gbps else "")
        lines.append(f"| {r['label']} | {r['ms']['dense']:.3f} | {r['ms']['naive']:.3f} | "
                     f"{r['ms']['certified']:.3f} | {r['ratio_vs_dense']['certified']:.2f} | "
                     f"{p2['ratio_vs_dense']:.2f} | {p2_gbps} | "
                     f"{100 * r['checks_share']:.1f} | {r['k_star_mean']:.1f} | "
                     f"{r['gbps']['dense']:.1f} | {r['gbps']['certified']:.1f} | {phases} | "
                     f"{mem['tier1'] / mem['dense']:.3f} |")
    return [*lines, "", *target_lines(records, peak_gbps)]


def target_lines(records: list[dict], peak_gbps: float | None) -> list[str]:
    """The #4 targets (GPU, N >= 32K): Phase 2 <= 0.75x dense at >= 60% of peak bandwidth;
    whole step at 64K <= 1.5x dense with the checks <= 5% of it."""
    if peak_gbps is None:
        return ["Targets (Phase 2 <= 0.75x dense at >= 60% of peak; whole step at 64K <= 1.5x "
                "dense, checks <= 5% of it) apply to the GPU kernels; this device has no known "
                "peak bandwidth, so they are not evaluated here."]
    lines = ["| target | case | measured | met |", "| --- | --- | --- | --- |"]
    for r in records:
        n = r["case"]["context"]
        if n >= 32768:
            p2 = r["phase2"]
            share = p2["gbps"] / peak_gbps
            lines.append(f"| phase 2 <= 0.75x dense | {r['label']} | {p2['ratio_vs_dense']:.2f}x "
                         f"| {'yes' if p2['ratio_vs_dense'] <= 0.75 else 'no'} |")
            lines.append(f"| phase 2 >= 60% of peak | {r['label']} | {100 * share:.0f}% | "
                         f"{'yes' if share >= 0.6 else 'no'} |")
        if n == 65536:
            ratio = r["ratio_vs_dense"]["certified"]
            lines.append(f"| step <= 1.5x dense | {r['label']} | {ratio:.2f}x | "
                         f"{'yes' if ratio <= 1.5 else 'no'} |")
            lines.append(f"| checks <= 5% of step | {r['label']} | "
                         f"{100 * r['checks_share']:.1f}% | "
                         f"{'yes' if r['checks_share'] <= 0.05 else 'no'} |")
    return lines


def plot_attention(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = sorted({(r["case"]["head_dim"], r["case"]["group"]) for r in records})
    colors = {"dense": "C0", "naive": "C1", "certified": "C2"}
    for (d, g), style in zip(labels, ("-", "--", ":", "-."), strict=False):
        rows = [r for r in records if (r["case"]["head_dim"], r["case"]["group"]) == (d, g)]
        ctx = [r["case"]["context"] for r in rows]
        for method, color in colors.items():
            ax.plot(ctx, [r["ms"][method] for r in rows], style, color=color, marker="o",
                    label=f"{method} d={d} {g}:1")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (one layer)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


MODEL_CONFIGS = {
    "smollm2_135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0},
    "llama31_8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "rope_theta": 500000.0},
}


def bench_decode(model: str, contexts: list[int], device: torch.device, repeats: int,
                 dtype: torch.dtype, compile: bool | str | None = None) -> list[dict]:
    """Whole-model decode step, dense vs certified, for a random-weight model config. Dense is
    the model's own cache and SDPA in its dtype (what a user would run instead)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from certkv.eval.decode import Method, Prefill
    from certkv.models.hook import enable
    from certkv.models.loading import LoadedModel, ModelSpec

    cfg = dict(MODEL_CONFIGS[model])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with device:  # random init on the device: an 8B model takes minutes to init on a CPU
        net = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    enable(net)
    lm = LoadedModel(net, None, ModelSpec(name=model))
    records = []
    for context in contexts:
        ids = torch.randint(0, config.vocab_size, (context,)).tolist()
        shared = Prefill(lm, ids[:-1])
        row = {"model": model, "context": context, "ms": {}, "phases_ms": {}}
        for mode in ("dense", "certified"):
            method = Method.build(mode, mode, compile=compile)
            attention = method.attention
            decoder = shared.session(method).decoder()
            token = ids[-1]
            row["ms"][mode] = timed(lambda d=decoder, t=token: d.step(t), repeats)
            timer = attention.timer = PhaseTimer()  # breakdown from a separate, synced step
            decoder.step(token)
            row["phases_ms"][mode] = dict(timer.ms)
        row["ratio"] = row["ms"]["certified"] / row["ms"]["dense"]
        attention = sum(row["phases_ms"]["certified"].values())
        row["phases_ms"]["certified"]["non_attention"] = max(row["ms"]["certified"] - attention,
                                                             0.0)
        records.append(row)
    return records


def decode_table(records: list[dict]) -> list[str]:
    order = ("non_attention", "layout", "phase1", "select", "page_in", "phase2", "certificate",
             "checks", "fallback")
    lines = ["| model | context | dense ms | certified ms | certified / dense | " +
             " | ".join(f"{p} %" for p in order) + " |", "|" + " --- |" * (5 + len(order))]
    for r in records:
        phases = r["phases_ms"]["certified"]
        total = sum(phases.values()) or 1.0
        shares = " | ".join(f"{100 * phases.get(p, 0) / total:.1f}" for p in order)
        lines.append(f"| {r['model']} | {r['context']} | {r['ms']['dense']:.1f} | "
                     f"{r['ms']['certified']:.1f} | {r['ratio']:.2f} | {shares} |")
    return lines


def plot_decode(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ctx = [r["context"] for r in records]
    for mode in ("dense", "certified"):
        ax.plot(ctx, [r["ms"][mode] for r in records], marker="o", label=mode)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("ms per decode step (whole model)")
    ax.set_title(records[0]["model"] if records else "")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
