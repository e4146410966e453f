"""Triton backend: Phase 1 from INT8 codes and Phase 2 from INT4 codes, fused in registers.

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
from certkv.kernels.layout import StepLayout, pad_block
from certkv.kernels.reference import Attended, TorchBackend, dense_attention
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

    split: int = 16  # blocks per Phase-2 program (split-KV)
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

    def score(self, q: torch.Tensor, lay: StepLayout, scaling: float) -> torch.Tensor:
        """Phase-1 logits ``[Hkv, G, n, B]``: quantized blocks in the kernel, the exact tail
        block (at most ``B - 1`` tokens) in PyTorch."""
        if not self._keys_supported(lay):
            return self.reference.score(q, lay, scaling)
        from certkv.kernels.triton_score import int8_block_scores

        store = lay.store
        blocks = store.key_blocks()
        s = int8_block_scores(q, blocks["codes"], blocks["scale"], blocks["offset"], scaling)
        if store.tail_len:
            tail = pad_block(store.tail()[0], store.block_size)
            s_tail = torch.einsum("kgd,kntd->kgnt", q.float(), tail) * scaling
            s = torch.cat([s, s_tail.masked_fill(~lay.valid[-1:], float("-inf"))], dim=2)
        return s

    def attend(self, scores: torch.Tensor, lay: StepLayout, staged) -> Attended:
        """Phase 2 in one split-KV kernel: INT4 values unpacked in registers, staged FP16 blocks
        (value promotion and the exact tail block) through a slot map."""
        if not self._values_supported(lay):
            return self.reference.attend(scores, lay, staged)
        from certkv.kernels.triton_attend import int4_attend

        store = lay.store
        hkv, n = store.num_kv_heads, lay.valid.shape[0]
        slot = torch.full((hkv, n), -1, dtype=torch.int32, device=scores.device)
        parts = []
        if staged is not None:
            slot[staged.kv_heads, staged.blocks] = torch.arange(
                staged.data.shape[0], dtype=torch.int32, device=scores.device)
            parts.append(staged.data)
        if store.tail_len:
            first = sum(p.shape[0] for p in parts)
            slot[:, -1] = torch.arange(first, first + hkv, dtype=torch.int32,
                                       device=scores.device)
            parts.append(pad_block(store.tail()[1], store.block_size)[:, 0].half())
        if not parts:
            parts.append(torch.zeros(1, store.block_size, store.head_dim, dtype=torch.float16,
                                     device=scores.device))
        blocks = store.value_blocks()
        return int4_attend(scores, blocks["codes"], blocks["scale"], blocks["offset"], slot,
                           torch.cat(parts), store.value_codec.group, self.split)

    def dense(self, q, k, v, scaling):
        return dense_attention(q, k, v, scaling)
