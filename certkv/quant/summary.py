"""Summary codecs: a block kept only as a summary in Tier-1 (certified eviction, seed 004's
rematerialisation; issue 23).

An evicted block's codes leave device memory; its FP16 originals stay in Tier-2. What Tier-1
keeps is enough to bound, at every step, what the block could contribute:

* keys: the per-channel minimum ``l_c`` and maximum ``u_c`` over the block's tokens (FP16,
  rounded outward). Decoded as the midpoint ``m_c = (l_c + u_c) / 2`` for every token, with the
  per-channel bound ``(u_c - l_c) / 2`` (plus the FP32 rounding of ``m_c``). The codec view turns
  the summary into the certificate's ``Delta_b = sum_c |q_c| (u_c - l_c) / 2`` (eq. 8), so the
  largest logit of the block is at most ``q . m + Delta_b = sum_c max(q_c l_c, q_c u_c)``: the
  bound of the block's logits from its summary, and its attention mass from that (Phase 1).
* values: the per-channel midrange ``c`` (FP16) and the radius ``r = max_t ||v_t - c||``
  (FP32, rounded up). Decoded as ``c`` for every token, so the block's value error is at most
  ``r`` per token: the certificate's ``eta_b`` (Cor. 4.2).

So an evicted block enters the certificate like any quantized block (E_key through ``Delta_b``,
E_val through ``eta_b = r``), and the ladder's key selection and value promotion page it back in
from Tier-2 when its share of the bound is large; the dense fallback is unchanged. Tier-1 per
block and kv head: ``4 d`` bytes of keys, ``2 d + 4`` of values (388 at d = 64 against 1,536 for
INT8 keys and INT4 values of 16 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import (
    FP32_EPS,
    Blocks,
    KeyCodec,
    ValueCodec,
    round_down_fp16,
    round_up_fp16,
    round_up_fp32,
)
from certkv.quant.layout import CodeLayout, keeps
from certkv.registry import KEY_CODECS, VALUE_CODECS


def _midpoint(low: torch.Tensor, high: torch.Tensor) -> torch.Tensor:
    """FP32 ``(low + high) / 2`` of FP16 bounds (what decode returns, one rounding)."""
    return (low.float() + high.float()) / 2


def _tokens(x: torch.Tensor, block: int | None) -> torch.Tensor:
    """A per-block row ``[Hkv, n, d]`` repeated for the block's ``block`` tokens."""
    require(block is not None, ConfigError,
            "a summary codec decodes blocks of the size it was validated for; call "
            "codec.validate(head_dim, block_size) first (TieredKVStore does).")
    return x.unsqueeze(-2).expand(*x.shape[:2], block, x.shape[-1]).clone()


@KEY_CODECS.register("summary")
@dataclass
class SummaryKeyCodec(KeyCodec):
    """Keys summarised by their per-channel range over the block (see the module docstring)."""

    bits: int = 0
    name: str = "summary"
    stores_codes = False
    _block: int | None = field(default=None, repr=False, compare=False)  # set by validate

    def kernel_layout(self) -> CodeLayout | None:
        """8-bit codes that are all zero, offset = the midpoint, scale = the half range: the
        kernel's ``r_c = a scale + b |offset|`` with ``(a, b) = (1, u32)`` is
        :meth:`channel_bound`."""
        return CodeLayout(False, 8, 0, (1.0, FP32_EPS)) if keeps(self, SummaryKeyCodec) else None

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """All-zero 8-bit ``codes [Hkv, slots, B, d]`` (stride 0) with FP32 ``offset`` = the
        midpoint, computed as :meth:`decode` does, and ``scale`` = the half range."""
        low, high = blocks["low"].float(), blocks["high"].float()
        hkv, slots, d = low.shape
        zeros = torch.zeros(d, dtype=torch.int8, device=low.device)
        return {"codes": zeros.expand(hkv, slots, block_size, d), "offset": (low + high) / 2,
                "scale": (high - low) / 2}

    def encode(self, k: torch.Tensor) -> Blocks:
        x = k.float()  # [Hkv, n, B, d]
        return {"low": round_down_fp16(x.amin(dim=-2)), "high": round_up_fp16(x.amax(dim=-2))}

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return _tokens(_midpoint(blocks["low"], blocks["high"]), self._block)

    def validate(self, head_dim: int, block_size: int) -> None:
        self._block = block_size

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        """``max_t |k_t,c - m_c| <= (u_c - l_c) / 2 + |m_c - fl(m_c)|``: the half range in FP64
        plus one FP32 rounding of the midpoint, rounded up to FP32."""
        low, high = blocks["low"].double(), blocks["high"].double()
        mid = (low + high) / 2
        return round_up_fp32((high - low) / 2 + FP32_EPS * mid.abs())


@VALUE_CODECS.register("summary")
@dataclass
class SummaryValueCodec(ValueCodec):
    """Values summarised by their per-channel midrange and radius (module docstring)."""

    bits: int = 0
    name: str = "summary"
    stores_codes = False
    _block: int | None = field(default=None, repr=False, compare=False)  # set by validate

    def validate(self, head_dim: int, block_size: int) -> None:
        self._block = block_size

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """FP16 blocks whose every token is the centre."""
        return CodeLayout(fp16=True) if keeps(self, SummaryValueCodec) else None

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """``data [Hkv, slots, B, d]``: the FP16 centre with stride 0 over tokens."""
        return {"data": blocks["centre"].unsqueeze(2).expand(-1, -1, block_size, -1)}

    def encode(self, v: torch.Tensor) -> Blocks:
        x = v.float()
        centre = ((x.amin(dim=-2) + x.amax(dim=-2)) / 2).to(torch.float16)  # [Hkv, n, d]
        radius = (v.double() - centre.double().unsqueeze(-2)).norm(dim=-1).amax(dim=-1)
        return {"centre": centre, "radius": round_up_fp32(radius)}

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return _tokens(blocks["centre"].float(), self._block)

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        radius = blocks["radius"]
        return _tokens(radius.unsqueeze(-1), self._block).squeeze(-1)
