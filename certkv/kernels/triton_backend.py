"""Triton backend: Phase 1 from INT8 codes, Phase 2 from INT4 codes and gated FP16 keys, and the
ranking/boundary checks, each one kernel.

Used automatically on CUDA (``backend=auto``); on CPU it runs under ``TRITON_INTERPRET=1``
(tests, small shapes). Codecs or shapes the kernels do not cover (sub-byte keys, INT8/2-bit
values, non-power-of-two B or d, FP64 scalars) fall back to the PyTorch reference per phase,
so results never depend on the backend beyond FP32 rounding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.kernels.layout import StagedBlocks, StepLayout, pad_block
from certkv.kernels.reference import Attended, Scored, TorchBackend, dense_attention
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import ChannelAffineKeyCodec


def _pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def triton_available() -> bool:
    """Triton importable and either a CUDA device or the interpreter (``TRITON_INTERPRET=1``)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@dataclass
class TritonBackend:
    """Fused kernels for INT8 keys / INT4 values; the reference for everything else."""

    split: int | None = None  # blocks per program in Phase 1 / 2 (None: by SM count)
    name: str = "triton"

    def __post_init__(self) -> None:
        require(triton_available(), ConfigError,
                "backend=triton needs triton and a CUDA GPU (or TRITON_INTERPRET=1 on CPU); use "
                "backend=torch.")
        self.reference = TorchBackend()

    def _keys_supported(self, lay: StepLayout) -> bool:
        codec, store = lay.store.key_codec, lay.store
        return (isinstance(codec, ChannelAffineKeyCodec) and codec.bits == 8
                and _pow2(store.block_size) and _pow2(store.head_dim))

    def _values_supported(self, lay: StepLayout) -> bool:
        codec, store = lay.store.value_codec, lay.store
        return (isinstance(codec, GroupAffineValueCodec) and codec.bits == 4
                and _pow2(store.block_size) and _pow2(store.head_dim))

    def phase1(self, q: torch.Tensor, lay: StepLayout, scaling: float) -> Scored:
        """Phase 1 for quantized blocks in one kernel (logits, log-masses, Delta_b); the exact
        tail block (at most ``B - 1`` tokens) in PyTorch."""
        if not self._keys_supported(lay):
            return self.reference.phase1(q, lay, scaling)
        from certkv.kernels.triton_score import int8_phase1

        store = lay.store
        blocks = store.key_blocks()
        s, log_mass, delta = int8_phase1(q, blocks["codes"], blocks["scale"], blocks["offset"],
                                         scaling, store.key_codec.bound_coefficients(),
                                         self.split)
        if store.tail_len:
            tail = pad_block(store.tail()[0], store.block_size)
            s_tail = torch.einsum("kgd,kntd->kgnt", q.float(), tail) * scaling
            s_tail = s_tail.masked_fill(~lay.valid[-1:], float("-inf"))
            s = torch.cat([s, s_tail], dim=2)
            log_mass = torch.cat([log_mass, torch.logsumexp(s_tail, dim=-1)], dim=2)
            delta = torch.cat([delta, torch.zeros_like(log_mass[..., :1])], dim=2)
        return Scored(scores=s, log_mass=log_mass, delta_b=delta)

    def phase2(self, q, scored: Scored, lay: StepLayout, gate, keys, values, scaling,
               eps_guard) -> Attended:
        """Phase 2 in one split-KV kernel: gated FP16-key logits (and the canary) on staged key
        blocks, INT4 values unpacked in registers, staged FP16 values (value promotion and the
        exact tail block) through slot maps."""
        if not self._values_supported(lay):
            return self.reference.phase2(q, scored, lay, gate, keys, values, scaling, eps_guard)
        from certkv.kernels.triton_attend import int4_attend

        store = lay.store
        shape = (store.num_kv_heads, lay.valid.shape[0])
        tail_v = None
        if store.tail_len:
            tail_v = pad_block(store.tail()[1], store.block_size)[:, 0].half()
        key_slot, key_data = slot_map(keys, shape, lay)
        value_slot, value_data = slot_map(values, shape, lay, tail_v)
        blocks = store.value_blocks()
        return int4_attend(scored, q, gate, key_slot, key_data, blocks, value_slot, value_data,
                           store.value_codec.group, scaling, eps_guard, self.split)

    def checks(self, l_int8, l_fp16, delta_b, promoted, tail, r):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]`` in one tiny kernel."""
        from certkv.kernels.triton_checks import ranking_and_boundary

        return ranking_and_boundary(l_int8, l_fp16, delta_b, promoted, tail, r)

    def dense(self, q, k, v, scaling):
        return dense_attention(q, k, v, scaling)


def slot_map(staged: StagedBlocks | None, shape: tuple[int, int], lay: StepLayout,
             tail: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot map ``[Hkv, n]`` (int32, -1: not staged) into FP16 blocks ``[P, B, d]``: the staged
    blocks, then (if given) the exact tail block ``tail [Hkv, B, d]`` of every kv head."""
    store = lay.store
    dev = store.device
    slot = torch.full(shape, -1, dtype=torch.int32, device=dev)
    parts = []
    if staged is not None:
        slot[staged.kv_heads, staged.blocks] = torch.arange(
            staged.data.shape[0], dtype=torch.int32, device=dev)
        parts.append(staged.data.half())
    if tail is not None:
        first = sum(p.shape[0] for p in parts)
        slot[:, -1] = torch.arange(first, first + shape[0], dtype=torch.int32, device=dev)
        parts.append(tail)
    if not parts:  # a valid pointer the kernel never reads
        parts.append(torch.zeros(1, store.block_size, store.head_dim, dtype=torch.float16,
                                 device=dev))
    return slot, torch.cat(parts)
