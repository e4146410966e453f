"""``certkv bench attention`` and ``certkv bench launches``: one decode step of one layer per
context length, head dim and GQA ratio, dense FP16 SDPA vs naive vs certified in one process,
with each phase timed, the bytes each method must read and memory per tier; or the launches and
host reads of one step."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from certkv.attention import CertifiedAttention
from certkv.bench.measure import Update, _quiet, medians, phase_stats, stats, timings, tokens
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.kernels.reference import dense_attention
from certkv.opcount import count_step
from certkv.quant.rope import RopeSpec


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

    @property
    def short_label(self) -> str:
        """For tables: ``N=4K d=128 4:1`` (context, head dim, query heads per kv head)."""
        return f"N={tokens(self.context)} d={self.head_dim} {self.group}:1"

    def build(self, device: torch.device, decoded_mirror: bool | str = False, quantizer=None):
        """``(store, q, k16, v16)``: the case's keys and values in a store (with
        ``decoded_mirror`` and ``quantizer``'s codecs, :class:`TieredKVStore`; None: the
        paper's INT8/INT4), a query, and the keys and values in FP16."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.kv_heads, self.context, self.head_dim)
        k = torch.randn(shape, generator=gen)
        k[..., : max(1, self.head_dim // 32)] *= 20  # outlier channels
        v = torch.randn(shape, generator=gen)
        if quantizer is not None:  # pre-RoPE codecs: these keys under LLaMA's theta 10,000
            quantizer = quantizer.with_rope(RopeSpec.from_theta(1e4, self.head_dim))
        codecs = {} if quantizer is None else quantizer.store_kwargs()
        store = TieredKVStore(self.kv_heads, self.head_dim, device=device,
                              decoded_mirror=decoded_mirror, **codecs)
        store.append(k.to(device), v.to(device))
        q = torch.randn(self.kv_heads * self.group, self.head_dim, generator=gen) * 2
        return store, q.to(device), k.to(device, torch.float16), v.to(device, torch.float16)


def bench_attention_case(case: AttentionCase, device: torch.device, repeats: int,
                         compile: bool | str | None = None, update: Update = _quiet,
                         backend: str = "auto") -> dict:
    """Time dense / naive / certified for one case; returns a JSON-able record (``compile``:
    as :class:`CertifiedAttention`; the first timed warm-up calls absorb compilation). Where
    the backend keeps the step on the device (Triton), ``certified-host`` times the same step
    with its page-in plan and fallback flags read on the host (``device_fallback=False``), the
    A/B of issue 24's host round-trips in one process.

    ``ms`` holds each method's median step time, ``ms_stats`` its min / median / max and runs.
    Whole-step times are taken without the phase timer (its per-phase synchronisation would
    inflate them); the phase breakdown (``phases_ms``: medians) comes from separate runs.
    """
    store, steps, methods = layer_steps(case, device, compile, backend)
    certified = methods["certified"]
    ms_stats = {}
    for method, step in steps.items():
        update(f"{case.short_label}: {method}")
        ms_stats[method] = stats(timings(step, repeats))
        update(f"{case.short_label}: {method}", advance=1)
    phase_ms = phase_stats(steps["certified"], certified)
    _, cert = steps["certified"]()
    dispatch = {m: count_step(steps[m], a) for m, a in methods.items()}
    return {**_attention_record(case, store, cert, ms_stats, phase_ms,
                                str(_dense_dtype(device))), "dispatch": dispatch}


def layer_steps(case: AttentionCase, device: torch.device, compile: bool | str | None,
                backend: str, quantizer=None, batch: int = 1) -> tuple[TieredKVStore, dict, dict]:
    """``(store, steps, methods)`` of one case: a callable step per method and its
    :class:`CertifiedAttention` (None for dense). ``dense`` decodes straight from a resident
    cache in the device's compute dtype (:func:`_dense_dtype`), converted once here;
    ``certified`` uses a scratch cache; where the backend keeps the step on the device
    (Triton), ``certified-host`` is the same step with its page-in plan and fallback flags
    read on the host (``device_fallback=False``); ``quantizer``: the store's (None: INT8/INT4);
    with ``batch`` above 1, ``certified xB``: one certified step of a batch of ``B`` sequences
    (:meth:`CertifiedAttention.batch`), from the case's context down to about half of it."""
    naive = CertifiedAttention(mode="naive", compile=compile, backend=backend)
    certified = CertifiedAttention(compile=compile, backend=backend)
    store, q, k16, v16 = case.build(device, certified.decoded_mirror(device), quantizer)
    scaling = case.head_dim ** -0.5
    dtype = _dense_dtype(device)
    qd, kd, vd = q.to(dtype), k16.to(dtype), v16.to(dtype)
    steps = {"dense": partial(dense_attention, qd, kd, vd, scaling),
             "naive": partial(naive, q, store),
             "certified": partial(certified, q, store, scratch=ScratchCache())}
    methods = {"dense": None, "naive": naive, "certified": certified}
    if certified.backend.falls_back_on_device:
        host = CertifiedAttention(compile=compile, backend=backend, device_fallback=False)
        steps["certified-host"] = partial(host, q, store, scratch=ScratchCache())
        methods["certified-host"] = host
    if batch > 1:
        steps[f"certified x{batch}"] = _batch_step(case, device, certified, quantizer, batch)
        methods[f"certified x{batch}"] = certified
    return store, steps, methods


def _batch_step(case: AttentionCase, device: torch.device, attention, quantizer, batch: int):
    """One certified step of a batch of ``batch`` sequences of the case's shape, ragged from
    its context down to about half of it, each with its own scratch cache."""
    built = [replace(case, context=case.context - i * case.context // (2 * batch),
                     seed=case.seed + i).build(device, attention.decoded_mirror(device),
                                               quantizer)
             for i in range(batch)]
    q = torch.stack([q for _, q, _, _ in built])
    return partial(attention.batch, q, [store for store, *_ in built],
                   scratches=[ScratchCache() for _ in built])


def _dense_dtype(device: torch.device) -> torch.dtype:
    """The dense baseline's compute dtype: FP16 on GPU, FP32 on CPU (no fast FP16 math)."""
    return torch.float16 if device.type == "cuda" else torch.float32


LAUNCH_METHODS = ("dense", "naive", "certified", "certified-host")
LAUNCH_SHAPES = ((128, 8, 4), (64, 3, 3))  # (head_dim, kv heads, query heads per kv head)
LAUNCH_NOTES = [
    "Triton: kernel launches. seg: calls of the step's pure tensor segments (selection, page-in "
    "bookkeeping, certificate where the kernels do not compute them: a naive step, other "
    "policies), each one compiled graph on CUDA (several kernels). eager: aten operators "
    "outside both that compute or copy (a launch each on CUDA; views and allocations are not "
    "counted). Issue 55's target: at most 6 Triton launches and nothing else per certified "
    "layer step. dense: SDPA on the FP16 cache on CUDA, the overflow-proof FP32 reference on "
    "CPU."]


def launch_notes(records: list[dict]) -> list[str]:
    """:data:`LAUNCH_NOTES`, and the precisions each case's store held (records that name
    them)."""
    held = [f"{r['short_label']}: {', '.join(r['precisions'])}" for r in records
            if r.get("precisions")]
    return [*LAUNCH_NOTES, *(["Precisions the store held (value codecs' labels): "
                              + "; ".join(held) + "."] if held else [])]


TUNE_OFF = "CERTKV_AUTOTUNE=0 pins num_warps=4, num_stages=3"


def tuning_notes(device: torch.device) -> list[str]:
    """On CUDA, the launch configuration tuning kept for each shape the tuned kernels ran at
    (:mod:`~certkv.kernels.triton_tune`); nothing elsewhere (no tuning there)."""
    if device.type != "cuda":
        return []
    from certkv.kernels.triton_tune import chosen

    rows = chosen()
    return [f"Triton launch configurations kept by tuning ({TUNE_OFF}): "
            + "; ".join(f"{name} at {shape}: {config}" for name, shape, config in rows)
            + "."] if rows else []


def bench_launches_case(case: AttentionCase, device: torch.device,
                        compile: bool | str | None = None, update: Update = _quiet,
                        quantizer=None, batch: int = 1) -> dict:
    """What one layer step of the Triton path dispatches, per method
    (:data:`LAUNCH_METHODS`, :func:`layer_steps`), without timing it (on CPU the kernels run
    under ``TRITON_INTERPRET=1``): Triton launches, segment calls, eager launching operators,
    host reads, aten operators and, on CUDA, the launches the profiler records
    (:class:`~certkv.opcount.StepCounter`), over a store of ``quantizer``'s (None: INT8/INT4)
    with its precisions held; with ``batch`` above 1 also a batch's certified step."""
    store, steps, methods = layer_steps(case, device, compile, "triton", quantizer, batch)
    dispatch = {}
    for method in steps:
        update(f"{case.short_label}: {method}")
        steps[method](), steps[method]()  # warm-up: compilation, the scratch's first fills
        dispatch[method] = count_step(steps[method], methods[method])
        update(f"{case.short_label}: {method}", advance=1)
    held = sorted({precision.label for precision, *_ in store.block_groups("value")})
    return {"case": case.__dict__, "label": case.label, "short_label": case.short_label,
            "dispatch": dispatch, "precisions": held}


def _attention_record(case: AttentionCase, store: TieredKVStore, cert, ms_stats: dict,
                      phase_ms: dict, dense_dtype: str) -> dict:
    """The JSON record of one case: times, ratios, GB/s, phases, memory per tier."""
    times = medians(ms_stats)
    phases = medians(phase_ms)
    dense_ms = times["dense"]
    traffic = _bytes_read(store, cert, case)
    step = sum(phases.values()) or 1.0
    p2 = phases.get("phase2", 0.0)
    return {"case": case.__dict__, "label": case.label, "short_label": case.short_label,
            "ms": times, "ms_stats": ms_stats, "dense_dtype": dense_dtype,
            "ratio_vs_dense": {m: t / dense_ms for m, t in times.items()},
            "gbps": {m: traffic[m] / times[m] / 1e6 for m in times},
            "phases_ms": phases, "phases_ms_stats": phase_ms,
            "k_star_mean": float(cert.k_star.float().mean()),
            "phase2": {"ms": p2, "ratio_vs_dense": p2 / dense_ms,
                       "gbps": traffic["phase2"] / max(p2, 1e-9) / 1e6},
            "checks_share": phases.get("checks", 0.0) / step,
            "memory_bytes": {"dense": store.dense_bytes(), "tier1": store.tier1_bytes(),
                             "tier2": store.tier2_bytes(), "annotations":
                             store.annotation_bytes(), "workspace": store.workspace_bytes()}}


def _bytes_read(store: TieredKVStore, cert, case: AttentionCase) -> dict[str, int]:
    """Bytes each method must move per step: dense reads the FP16 cache; naive and certified
    read Tier-1 (certified also its promoted FP16 blocks); Phase 2 alone reads the INT4 values,
    the Phase-1 logits (FP32, one per query head and token) and the promoted FP16 blocks."""
    block_bytes = store.block_size * case.head_dim * 2
    promoted = (int(cert.k_star.sum()) + int(cert.value_promotions)) * block_bytes
    logits = 4 * case.kv_heads * case.group * store.num_tokens
    values = store.value_blocks()
    value_bytes = sum(t.numel() * t.element_size() for t in values.values())
    certified = store.tier1_bytes() + promoted  # the same bytes, paged in either way
    return {"dense": store.dense_bytes(), "naive": store.tier1_bytes(),
            "certified": certified, "certified-host": certified,
            "phase2": value_bytes + logits + promoted}


def default_cases(device: torch.device) -> list[AttentionCase]:
    """GPU: 4K-128K at d=64 and 128, GQA 4:1 and 3:1; CPU: small sizes so it always runs."""
    contexts = [4096, 16384, 32768, 65536, 131072] if device.type == "cuda" else [1024, 4096]
    shapes = [(128, 8, 4), (64, 3, 3)]
    return [AttentionCase(n, d, hkv, g) for n in contexts for d, hkv, g in shapes]
