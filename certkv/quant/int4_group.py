"""Per-token, per-group affine value codec (paper 2.3, "Per-group INT4 values").

Each value vector is split into ``d / g`` groups of ``g`` channels; each group gets an FP16 scale
``s = (max - min) / (2**bits - 1)`` (rounded up to FP16 so nothing clips) and the FP16 offset
``min``; codes are unsigned ``bits``-wide integers packed along the channel axis. Storage per
token is ``d * bits / 8 + 4 * d / g`` bytes (96 at d=128, g=16, 4 bits: Table 13).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import Blocks, ValueCodec, round_up_fp16
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import VALUE_CODECS


@VALUE_CODECS.register("group_affine")
@dataclass
class GroupAffineValueCodec(ValueCodec):
    """Values: FP16 scale and offset per ``group`` channels per token; ``bits`` in {2, 3, 4, 8}."""

    bits: int = 4
    group: int = 16
    name: str = "int4_group"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        require(self.group >= 1, ConfigError,
                f"value_group={self.group} must be a positive integer such as 16.")

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "value")
        divisor = max(c for c in range(1, min(head_dim, 16) + 1) if head_dim % c == 0)
        require(head_dim % self.group == 0, ConfigError,
                f"value_group={self.group} does not divide head_dim={head_dim}; use a divisor "
                f"of {head_dim}, e.g. value_group={divisor}.")

    def _grouped(self, v: torch.Tensor) -> torch.Tensor:
        return v.reshape(*v.shape[:-1], v.shape[-1] // self.group, self.group)

    def encode(self, v: torch.Tensor) -> Blocks:
        x = self._grouped(v.float())  # [Hkv, n, B, d/g, g]
        lo = x.amin(dim=-1, keepdim=True)
        hi = x.amax(dim=-1, keepdim=True)
        scale = round_up_fp16((hi - lo) / ((1 << self.bits) - 1))
        offset = lo.to(torch.float16)  # exact: the originals are FP16
        safe = torch.where(scale > 0, scale.float(), torch.ones_like(lo))
        codes = torch.round((x - offset.float()) / safe).clamp(0, (1 << self.bits) - 1)
        codes = codes.reshape(*v.shape).to(torch.uint8)
        return {
            "codes": pack_bits(codes, self.bits),
            "scale": scale.squeeze(-1),
            "offset": offset.squeeze(-1),
        }

    def decode(self, blocks: Blocks) -> torch.Tensor:
        codes = unpack_bits(blocks["codes"], self.bits).float()
        grouped = self._grouped(codes)
        scale = blocks["scale"].float().unsqueeze(-1)
        offset = blocks["offset"].float().unsqueeze(-1)
        out = grouped * scale + offset
        return out.reshape(codes.shape)

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """``bits``-wide codes (2, 3, 4 or 8) with a scale per token per group of channels."""
        if (not keeps(self, GroupAffineValueCodec) or self.bits not in KERNEL_BITS
                or head_dim % self.group):
            return None
        return CodeLayout(False, self.bits, group=self.group)

    def decode_rounding(self, head_dim: int | None = None) -> float:
        """Decode is ``code * s + o``: one evaluation errs by at most ``2u (|code s| + |o|)``
        per channel, two differ by twice that. ``o`` is the group minimum and
        ``code s <= (hi - lo) + s/2`` with ``s <= (hi - lo) / (2^b - 1) (1 + 2^-10) + 2^-24``
        (FP16 rounding up, subnormals included), so ``|code s| + |o| <= 3.2 max_group |v| +
        2^-24`` and, in l2, ``<= 3.2 sqrt(g) ||v|| + 2^-24 sqrt(d)``:
        ``c = 4 * 3.2 (1 + u) sqrt(g) <= 13 sqrt(g)``."""
        return 13.0 * self.group**0.5

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        half = blocks["scale"].float() / 2  # [Hkv, n, B, d/g]
        return torch.sqrt((half.square() * self.group).sum(dim=-1)) * (1 + 1e-5)
