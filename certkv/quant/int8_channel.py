"""Per-channel, per-block affine key codec (paper 2.3, eq. 2-3; KVQuant-style).

For a completed block with channel minimum ``l_c`` and maximum ``u_c`` the scale is
``sigma_c = (u_c - l_c) / (2**bits - 1)`` and the offset ``z_c = l_c + 2**(bits-1) * sigma_c``, so
every value of the block is representable without clipping and round-to-nearest gives
``|k - k_hat| <= sigma_c / 2``. A constant channel (``u_c == l_c``) gets ``sigma_c = 0`` and
reconstructs exactly. Scales and offsets are FP32 (``2d`` floats per block), codes are signed
``bits``-wide integers (int8 storage at 8 bits, packed unsigned below that).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.quant.base import FP32_EPS, Blocks, KeyCodec
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import KEY_CODECS

# Headroom for FP32 rounding in encode/decode, relative to the magnitude being reconstructed:
# a few ulps, far below sigma/2 for any real block, and enough to make the bound rigorous.
_FP_SLACK = 16 * FP32_EPS


@KEY_CODECS.register("channel_affine")
@dataclass
class ChannelAffineKeyCodec(KeyCodec):
    """Keys: one FP32 scale and offset per channel per block; ``bits`` in {2, 3, 4, 8}."""

    bits: int = 8
    name: str = "int8_channel"

    def __post_init__(self) -> None:
        check_bits(self.bits)

    @property
    def _half_range(self) -> int:
        return 1 << (self.bits - 1)

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "key")

    def encode(self, k: torch.Tensor) -> Blocks:
        x = k.float()
        lo = x.amin(dim=-2, keepdim=True)
        hi = x.amax(dim=-2, keepdim=True)
        scale = (hi - lo) / ((1 << self.bits) - 1)
        offset = lo + self._half_range * scale
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        codes = torch.round((x - offset) / safe)
        codes = codes.clamp(-self._half_range, self._half_range - 1).to(torch.int16)
        return {
            "codes": self._store_codes(codes),
            "scale": scale.squeeze(-2),
            "offset": offset.squeeze(-2),
        }

    def _store_codes(self, codes: torch.Tensor) -> torch.Tensor:
        if self.bits == 8:
            return codes.to(torch.int8)
        return pack_bits((codes + self._half_range).to(torch.uint8), self.bits)

    def codes(self, blocks: Blocks) -> torch.Tensor:
        """Signed integer codes ``[Hkv, n, B, d]`` (int16) of stored blocks."""
        stored = blocks["codes"]
        if self.bits == 8:
            return stored.to(torch.int16)
        return unpack_bits(stored, self.bits).to(torch.int16) - self._half_range

    def decode(self, blocks: Blocks) -> torch.Tensor:
        scale = blocks["scale"].unsqueeze(-2)
        offset = blocks["offset"].unsqueeze(-2)
        return self.codes(blocks).float() * scale + offset

    def kernel_layout(self) -> CodeLayout | None:
        """``bits``-wide codes per channel (2, 3, 4 or 8; int8 stored signed, others biased)."""
        if not keeps(self, ChannelAffineKeyCodec) or self.bits not in KERNEL_BITS:
            return None
        bias = 0 if self.bits == 8 else 1 << (self.bits - 1)
        return CodeLayout(False, self.bits, bias, self.bound_coefficients())

    def bound_coefficients(self) -> tuple[float, float]:
        """``(a, b)`` with ``r_c = a sigma_c + b |z_c|`` (0 where ``sigma_c = 0``): ``sigma_c / 2``
        plus the FP32 headroom on the magnitude ``|z_c| + 2**(bits-1) sigma_c``. Fused kernels
        compute Delta_b from the scales they already read with these."""
        return 0.5 + _FP_SLACK * self._half_range, _FP_SLACK

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        """``code * sigma_c + z_c`` with ``|code| <= 2^(bits-1)``: one FP32 evaluation errs by at
        most ``2u (2^(bits-1) sigma_c + |z_c|)`` (a product and a sum, or one FMA), two differ by
        twice that, inside ``_FP_SLACK (2^(bits-1) sigma_c + |z_c|)``; exact where
        ``sigma_c = 0`` (code 0, offset ``l_c``)."""
        scale, offset = blocks["scale"], blocks["offset"]
        slack = _FP_SLACK * (self._half_range * scale + offset.abs())
        return torch.where(scale > 0, slack, torch.zeros_like(slack))

    def slack_coefficients(self) -> tuple[float, float]:
        """``(a, b)``: :meth:`decode_slack` is ``a sigma_c + b |z_c|`` where ``sigma_c > 0`` (up
        to the FP32 rounding of its evaluation)."""
        return _FP_SLACK * self._half_range, _FP_SLACK

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        scale, offset = blocks["scale"], blocks["offset"]
        a, b = self.bound_coefficients()
        bound = a * scale + b * offset.abs()
        return torch.where(scale > 0, bound, torch.zeros_like(bound))  # constant channel: exact


def is_int8(codec) -> bool:
    """Whether ``codec`` is the default INT8 key codec (what the CPU loops decode in place:
    :mod:`certkv.kernels.numba_logits`; a lean decoded mirror keeps no decoded keys for it)."""
    return keeps(codec, ChannelAffineKeyCodec) and codec.bits == 8
