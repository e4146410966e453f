"""KIVI keys: per-channel asymmetric quantization over a block of tokens (Liu et al., 2024).

KIVI quantizes keys per channel over a group of tokens (here the block of ``B`` tokens) with a
zero-point, and values per token over groups of channels. The value side is exactly
:class:`~certkv.quant.int4_group.GroupAffineValueCodec` with ``group=32`` (KIVI's G), so this
module only adds the key codec.

For a completed block with channel minimum ``l_c`` and maximum ``h_c`` (FP16 originals) the
codec stores

* the zero-point ``l_c`` in FP16 (exact: it is one of the originals);
* the scale ``s_c``: the FP16 number obtained by rounding ``(h_c - l_c) / (2^b - 1)`` up, so that
  ``(2^b - 1) s_c >= h_c - l_c`` holds exactly (checked in FP64 and bumped by one FP16 ulp where
  it does not);
* unsigned ``b``-bit codes ``q = round((k - l_c) / s_c)``, packed along the channels;

and decodes ``k_hat = q s_c + l_c`` in FP32. Tier-1 holds ``B d b / 8`` code bytes plus 4 bytes
of metadata per channel per block (KIVI's two FP16 numbers), e.g. ``64 * 32 * 2 / 8 + 4 * 64 =
768`` bytes for a 2-bit block of ``B = 32`` tokens at ``d = 64`` (24 bytes per token), against
8 bytes per channel for :class:`~certkv.quant.int8_channel.ChannelAffineKeyCodec`.

**No clipping.** FP16 numbers are multiples of ``2^-24`` below ``2^16`` in magnitude, so
``k - l_c`` and ``h_c - l_c`` (at most 41 significant bits) are exact in FP64, and so is the
check ``(2^b - 1) s_c >= h_c - l_c`` (an 8-bit integer times an FP16 number). Subnormals change
nothing: a positive spread rounds up to at least the smallest subnormal ``2^-24``, so ``s_c > 0``
whenever ``h_c > l_c``, however much the rounding up enlarged it. Then
``0 <= (k - l_c) / s_c <= (h_c - l_c) / s_c <= 2^b - 1`` exactly, and the FP64 quotient stays in
``[0, 2^b - 1]`` because correctly rounded division is monotone and both ends are representable;
rounding to the nearest integer keeps it there. The clamp to ``[0, 2^b - 1]`` is never active.

**Bound** (per channel, every token of the block). With ``Q`` the exact quotient and ``Q'`` its
FP64 value, ``|Q - Q'| <= 2^-53 Q <= 2^-53 (2^b - 1)`` and ``|Q' - q| <= 1/2``, so the exact
``q s_c + l_c`` is within ``s_c (1/2 + 2^-45)`` of ``k``. Decode rounds once in FP32 (``q s_c``
is exact: 8 bits times 11), adding at most ``u |q s_c + l_c| <= u ((2^b - 1) s_c + |l_c|)``
(``u = 2^-24``; the sum is a multiple of ``2^-24``, so no FP32 subnormal is involved). The
stated bound ``r_c = (1/2 + 8u (2^b - 1)) s_c + 8u |l_c|`` covers both with room for its own
FP32 evaluation (three roundings, ``<= 2u r_c``). A constant channel (``s_c = 0``) gets code 0
and decodes to ``l_c = k`` exactly: ``r_c = 0``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.quant.base import FP32_EPS, Blocks, KeyCodec, round_up_fp16
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import KEY_CODECS

# Headroom for FP32 rounding, relative to the reconstructed magnitude (module docstring).
_FP_SLACK = 8 * FP32_EPS


def fp16_step(span: torch.Tensor, levels: int) -> torch.Tensor:
    """The FP16 scale of an FP64 spread ``span >= 0`` over ``levels`` steps: ``span / levels``
    rounded up to FP16 and bumped by one ulp wherever ``levels * s < span`` (an exact FP64
    comparison when ``span`` is exact), so ``levels * s >= span`` always holds. ``s = 0`` exactly
    where ``span == 0``."""
    scale = round_up_fp16(span / levels)
    short = scale.double() * levels < span
    return torch.where(short, torch.nextafter(scale, torch.full_like(scale, float("inf"))), scale)


@KEY_CODECS.register("kivi")
@dataclass
class KiviKeyCodec(KeyCodec):
    """Keys: FP16 scale and zero-point per channel per block, unsigned ``bits`` in {2, 3, 4, 8}.

    Stored per block: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale`` and ``offset``
    (the zero-point, the channel minimum) FP16 ``[Hkv, n, d]``.
    """

    bits: int = 4
    name: str = "kivi"

    def __post_init__(self) -> None:
        check_bits(self.bits)

    @property
    def levels(self) -> int:
        """The largest code, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "key")

    def encode(self, k: torch.Tensor) -> Blocks:
        x = k.to(torch.float16).double()  # FP16 originals; every step below is exact in FP64
        lo = x.amin(dim=-2)  # [Hkv, n, d]
        scale = fp16_step(x.amax(dim=-2) - lo, self.levels)
        safe = torch.where(scale > 0, scale.double(), torch.ones_like(lo))
        codes = torch.round((x - lo.unsqueeze(-2)) / safe.unsqueeze(-2))
        codes = codes.clamp(0, self.levels).to(torch.uint8)  # never active (module docstring)
        return {
            "codes": pack_bits(codes, self.bits),
            "scale": scale,
            "offset": lo.to(torch.float16),
        }

    def codes(self, blocks: Blocks) -> torch.Tensor:
        """Unsigned integer codes ``[Hkv, n, B, d]`` (uint8) of stored blocks."""
        return unpack_bits(blocks["codes"], self.bits)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        scale = blocks["scale"].float().unsqueeze(-2)
        offset = blocks["offset"].float().unsqueeze(-2)
        return self.codes(blocks).float() * scale + offset

    def kernel_layout(self) -> CodeLayout | None:
        """``bits``-wide unsigned codes per channel (2, 3, 4 or 8)."""
        if not keeps(self, KiviKeyCodec) or self.bits not in KERNEL_BITS:
            return None
        return CodeLayout(False, self.bits, 0, self.bound_coefficients())

    def bound_coefficients(self) -> tuple[float, float]:
        """``(a, b)`` with ``r_c = a s_c + b |l_c|`` (0 where ``s_c = 0``): half a step plus the
        FP32 headroom on the magnitude ``(2^b - 1) s_c + |l_c|`` (module docstring)."""
        return 0.5 + _FP_SLACK * self.levels, _FP_SLACK

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        """``q s_c + l_c`` with ``q s_c`` exact in FP32: any evaluation (product then sum, or one
        FMA) errs by at most ``u ((2^b - 1) s_c + |l_c|)``, two differ by at most twice that,
        inside ``8u ((2^b - 1) s_c + |l_c|)`` also after this bound's own FP32 rounding; exact
        where ``s_c = 0`` (code 0, offset ``l_c``)."""
        scale, offset = blocks["scale"].float(), blocks["offset"].float()
        slack = _FP_SLACK * (self.levels * scale + offset.abs())
        return torch.where(scale > 0, slack, torch.zeros_like(slack))

    def slack_coefficients(self) -> tuple[float, float]:
        """``(a, b)``: :meth:`decode_slack` is ``a s_c + b |l_c|`` where ``s_c > 0`` (up to the
        FP32 rounding of its evaluation)."""
        return _FP_SLACK * self.levels, _FP_SLACK

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        scale, offset = blocks["scale"].float(), blocks["offset"].float()
        a, b = self.bound_coefficients()
        bound = a * scale + b * offset.abs()
        return torch.where(scale > 0, bound, torch.zeros_like(bound))  # constant channel: exact
