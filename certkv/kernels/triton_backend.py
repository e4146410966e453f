"""Triton backend: Phase 1 from key codes, Phase 2 from value codes and gated FP16 keys, and
the ranking/boundary checks.

Each phase is one launch, its programs grouped by precision (the exact tail block rides with the
last group; ``triton_sources``): keys FP16 or 2/3/4/8-bit per channel (INT8 channel-affine, KIVI),
values FP16 or 2/3/4/8-bit per group, in any mix (exact sink and residual windows included). Used
automatically on CUDA (``backend=auto``); on CPU it runs under ``TRITON_INTERPRET=1`` (tests, small
shapes). InnerQ's groups, seed 004's Hadamard-rotated codes and KVQuant's pre-RoPE keys and
dense-and-sparse values are read by the same launches; codecs or shapes the kernels do not cover
(a codec that claims no kernel layout, non-power-of-two B or d) fall back to the PyTorch
reference per phase, with a one-time notice, so results never depend on the backend beyond FP32
rounding.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from certkv.certify.arith import Rounding, dot_depth
from certkv.errors import ConfigError, require
from certkv.kernels.base import Backend
from certkv.kernels.launch_hooks import quiet_interpreter
from certkv.kernels.layout import SlotMap, StagedBlocks, StepLayout
from certkv.kernels.reference import (
    Attended,
    CheckInputs,
    Scored,
    TorchBackend,
    dense_attention,
)

_NOTICED: set = set()  # (phase inputs, quantizer) already noticed as not covered


def triton_available() -> bool:
    """Triton importable and either a CUDA device or the interpreter (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonBackend(Backend):
    """Fused kernels for FP16, 2/3/4/8-bit affine, per-token symmetric, InnerQ, rotated,
    pre-RoPE and dense-and-sparse blocks of any mix of precisions
    (:class:`~certkv.quant.layout.CodeLayout`); the reference for every other codec."""

    split: int | None = None  # blocks per program in Phase 1 / 2 (None: by SM count)
    name: str = "triton"
    falls_back_on_device = True  # dense_flagged: one launch over the flagged heads

    def __post_init__(self) -> None:
        require(triton_available(), ConfigError,
                "backend=triton needs triton and a CUDA GPU (or TRITON_INTERPRET=1 on CPU); use "
                "backend=torch.")
        quiet_interpreter()
        self.reference = TorchBackend()

    def _sources(self, lay: StepLayout, which: str) -> list | None:
        """The kernel launches of one phase (``which``: ``"key"`` or ``"value"``), or None
        where a held precision is not covered; the first time a kind of store is not, one
        notice says so."""
        sources = lay.kernel_sources(which)
        if sources is not None:  # the hot path: no repr of the quantizer per phase call
            return sources
        store = lay.store
        key = (which, repr(store.quantizer))
        if key not in _NOTICED:
            _NOTICED.add(key)
            warnings.warn(f"the Triton kernels read {which}s as FP16, 2/3/4/8-bit affine codes "
                          f"(keys per channel, values per group), per-token symmetric codes, "
                          f"InnerQ's groups, rotated codes, pre-RoPE keys or dense-and-sparse "
                          f"values of the codecs that claim a kernel layout (powers of two B "
                          f"and d); a store with {store.quantizer.label} at "
                          f"B={store.block_size}, d={store.head_dim} runs that phase on the "
                          "PyTorch reference.", RuntimeWarning, stacklevel=4)
        return None

    def phase1(self, q: torch.Tensor, lay: StepLayout, scaling: float) -> Scored:
        """Phase 1, one launch over every precision's blocks and the exact tail block:
        logits, log-masses, log-spreads and Delta_b of every block at its index."""
        sources = self._sources(lay, "key")
        if sources is None:
            return self.reference.phase1(q, lay, scaling)
        from certkv.kernels.triton_score import score_blocks

        s, log_mass, delta, log_spread = score_blocks(q, sources, lay.num_blocks,
                                                      lay.store.block_size, scaling, self.split)
        return Scored(scores=s, log_mass=log_mass, delta_b=delta, log_spread=log_spread)

    def phase2(self, q, scored: Scored, lay: StepLayout, gate, staged, scaling, eps_guard,
               checks: CheckInputs | None = None, *, certify=None) -> Attended:
        """Phase 2, one split-KV launch over every precision (the last carrying the tail block) and
        one merge: gated FP16-key logits (and the canary) on staged key blocks, value codes
        unpacked in registers, staged FP16 values (value promotion) and exact blocks read in
        place; the ranking and boundary checks (``checks``) and the certificate (``certify``,
        a :class:`~certkv.kernels.triton_certify.CertifyRequest`) in the merge's epilogue."""
        sources = self._sources(lay, "value")
        if sources is None:
            return self.reference.phase2(q, scored, lay, gate, staged, scaling, eps_guard,
                                         checks)
        keys, values = staged
        from certkv.kernels.triton_attend import FP16Slots, attend_blocks

        shape = (lay.store.num_kv_heads, lay.num_blocks)
        key_slot, key_data = slot_map(keys, shape, lay)
        value_slot, value_data = slot_map(values, shape, lay)
        tier2 = None
        if isinstance(keys, SlotMap) or isinstance(values, SlotMap):
            tier2 = lay.store.original_rows()[:2] if lay.num_completed else None
        fp16 = FP16Slots(key_slot, key_data, value_slot, value_data, tier2)
        return attend_blocks(scored, q, gate, sources, fp16, scaling, eps_guard,
                             split=self.split, checks=checks, certify=certify)

    def decoded_mirror(self, device: torch.device) -> bool | str:
        """The reference's (:meth:`TorchBackend.decoded_mirror`): it runs every phase the
        kernels do not cover."""
        return self.reference.decoded_mirror(device)

    def in_place(self, store) -> str:
        """Which FP16 originals a host page-in leaves to Phase 2 (none: its kernels read
        staged blocks, :meth:`pages_in_on_device`)."""
        return ""

    def pages_in_on_device(self, lay: StepLayout) -> bool:
        """Whether Phase 2 runs the kernels for this store (so that it can read slot maps the
        host never saw, :class:`SlotMap`); the reference needs the page-in on the host."""
        return lay.kernel_sources("value") is not None

    def select(self, selector, ladder, value_policy, x):
        """The default policy's selection in one launch on a device step
        (:mod:`~certkv.kernels.triton_select`); None for a host ``n_q`` (the host path)."""
        if not isinstance(x.n_q, torch.Tensor):
            return None
        from certkv.kernels.triton_select import select

        return select(selector, ladder, value_policy, x)

    def certifies_in_phase2(self, lay: StepLayout) -> bool:
        """Whether Phase 2 runs the kernels for this store: its merge then computes the
        certificate (:mod:`~certkv.kernels.triton_certify`)."""
        return lay.kernel_sources("value") is not None

    def takes_empty_tail(self, lay: StepLayout) -> bool:
        """Whether both phases run the kernels over this store, which take a tail block with
        no token (:class:`StepLayout`'s ``empty_tail``; the reference's would not)."""
        return (lay.kernel_sources("key") is not None
                and lay.kernel_sources("value") is not None)

    # ---------------------------------------------------------------- a batch, stage by stage
    def steps_batch_on_device(self, lays) -> bool:
        """Whether both phases of every layout run the kernels (a batch's stages are then one
        launch each over its sequences, :mod:`certkv.batch_step`)."""
        return all(self.takes_empty_tail(lay) for lay in lays)

    def phase1_batch(self, qg: torch.Tensor, lays: list, scaling: float) -> Scored:
        """Phase 1 of a batch in one launch: ``qg [S, Hkv, G, d]``, one layout per sequence;
        :class:`Scored` with a leading sequence axis (``W`` block columns, the widest layout's:
        sequence ``s``'s first ``n_s``)."""
        from certkv.kernels.triton_score import score_batch

        block = lays[0].store.block_size
        s, log_mass, delta, log_spread = score_batch(
            qg, [lay.kernel_sources("key") for lay in lays], [lay.num_blocks for lay in lays],
            block, scaling, self.split)
        return Scored(scores=s, log_mass=log_mass, delta_b=delta, log_spread=log_spread)

    def select_batch(self, selector, ladder, value_policy, x, stores: list):
        """The default policy's selection of a batch in one launch
        (:func:`~certkv.kernels.triton_select.select_batch`)."""
        from certkv.kernels.triton_select import select_batch

        return select_batch(selector, ladder, value_policy, x, stores)

    def phase2_batch(self, batch, scaling: float, eps_guard: float, checks=None, certify=None):
        """Phase 2 of a batch and its merge, the checks and the certificate in its epilogue, in
        two launches (:func:`~certkv.kernels.triton_attend.attend_batch`)."""
        from certkv.kernels.triton_attend import attend_batch

        return attend_batch(batch, scaling, eps_guard, split=self.split, checks=checks,
                            certify=certify)

    def dense_flagged_batch(self, q, stores: list, out, scaling: float, finish):
        """Rungs 3-4 of a batch in one launch, the rungs decided first
        (:func:`~certkv.kernels.triton_fallback.dense_flagged_batch`)."""
        from certkv.kernels.triton_fallback import dense_flagged_batch

        parts = [(store.originals(), store.tail_buffers(), store.block_counts())
                 for store in stores]
        return dense_flagged_batch(q, None, parts, out, scaling, finish)

    def checks(self, l_int8, l_fp16, delta_b, promoted, quantized, r):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]`` in one tiny kernel."""
        from certkv.kernels.triton_checks import ranking_and_boundary

        return ranking_and_boundary(l_int8, l_fp16, delta_b, promoted, quantized, r)

    def dense(self, q, k, v, scaling):
        return dense_attention(q, k, v, scaling)

    def dense_flagged(self, q, flags, store, out, scaling, finish=None):
        """Rungs 3-4 from the device's flags (no host read): dense attention on the FP16
        originals (Tier-2 in place, the tail block on the device) written into the rows of
        ``out [Hq, d]`` (FP32) whose ``flags [Hq]`` are set; with ``finish``, the rungs of a
        certificate Phase 2's merge computed decided first, in the same launch
        (:func:`~certkv.kernels.triton_fallback.dense_flagged`)."""
        from certkv.kernels.triton_fallback import dense_flagged

        return dense_flagged(q, flags, store.originals(), store.tail_buffers(),
                             store.block_counts(), out, scaling, finish)

    def fallback_rounding(self, store) -> Rounding:
        """The rounding chain of :meth:`dense_flagged` (arith item 4)."""
        from certkv.kernels.triton_fallback import fallback_rounding

        return fallback_rounding(store.block_size)

    def rounding(self, lay: StepLayout) -> Rounding:
        """Rounding chain of the fused Phase 2 (arith item 4), or the reference's where a phase
        falls back. A weight takes its own exponential, the rescaling into its split's running
        maximum and every later one (at most ``SPLIT`` blocks per program), and the merge's;
        a numerator term the product, ``B - 1`` additions, two roundings per online-softmax
        update, the merge's product, its additions over splits (a tree within chunks of 64
        splits, then one per chunk: at most ``64 + n / 64``) and the division. Plain FP32
        multiply-adds: no reduced-precision matmul."""
        reference = self.reference.rounding(lay)
        if self._sources(lay, "value") is None or self._sources(lay, "key") is None:
            return reference  # a phase runs the reference (BLAS dot products, any order)
        from certkv.kernels.triton_score import MAX_SPLIT

        split = self.split or (MAX_SPLIT if lay.store.device.type == "cuda" else 4)
        return Rounding(exps=split + 3, depth=lay.store.block_size + 2 * split + 64 + 6,
                        depth_per_block=1 / 64, dot_depth=dot_depth(lay.store.head_dim))


def slot_map(staged: StagedBlocks | SlotMap | None, shape: tuple[int, int],
             lay: StepLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot map ``[Hkv, n]`` (int32, -1: not staged) into the staged FP16 blocks ``[P, B, d]``
    (read in place, the scratch pool included; a one-block dummy when nothing is staged). A
    :class:`SlotMap` made on the device is passed through."""
    if isinstance(staged, SlotMap):
        return staged.slot, staged.pool
    store = lay.store
    dev = store.device
    slot = torch.full(shape, -1, dtype=torch.int32, device=dev)
    if staged is None:  # a valid pointer the kernel never reads
        return slot, torch.zeros(1, store.block_size, store.head_dim, dtype=torch.float16,
                                 device=dev)
    rows = staged.rows
    if rows is None:
        rows = torch.arange(staged.data.shape[0], device=dev)
    slot[staged.kv_heads, staged.blocks] = rows.to(torch.int32)
    return slot, staged.data.half()
