"""SmartKV's quantizer (seed 001): symmetric, one scale per (token, kv head), ``bits`` in {2, 3,
4, 8}.

For a token's vector ``x`` (keys or values of one kv head, ``d`` channels) with ``qmax =
2^(b-1) - 1`` the codec stores the FP16 scale ``s >= max_j |x_j| / qmax`` (rounded up, bumped
one ulp where the FP64 check ``qmax s >= max |x|`` fails, as :func:`~certkv.quant.kivi.fp16_step`)
and the codes ``q = round(x / s)`` in ``[-qmax, qmax]`` (the seed's clamp to ``qmin = -2^(b-1)``
is never active: ``|x / s| <= qmax``), stored offset by ``2^(b-1)`` as unsigned ``b``-bit codes.
At 2 bits only ``{-1, 0, 1}`` occur, at 3 bits ``-3..3`` (seed 001's quantizer, exactly).

**Bound.** ``|x - q s| <= s (1/2 + 2^-53 qmax)`` (the FP64 quotient is within ``2^-53 qmax`` of
the exact one before rounding to an integer) and decode ``q s`` is exact in FP32 (8 bits times
11), so ``r_t = (1/2 + 8u qmax) s_t`` holds for every channel of token ``t`` with room for its
own FP32 evaluation. Keys: the per-channel bound over a block is ``max_t r_t``; values: the
token's l2 bound is ``r_t sqrt(d)``. Decode is exact in any FP32 evaluation: no decode slack,
no decode rounding. Tier-1 holds ``d b / 8`` code bytes and 2 scale bytes per token and head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from certkv.quant.base import FP32_EPS, Blocks, KeyCodec, ValueCodec
from certkv.quant.kivi import fp16_step
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import KEY_CODECS, VALUE_CODECS


def _qmax(bits: int) -> int:
    return (1 << (bits - 1)) - 1


def encode_tokens(x: torch.Tensor, bits: int) -> Blocks:
    """FP16 vectors ``[..., d]`` -> ``codes`` uint8 ``[..., d * bits / 8]`` and ``scale`` FP16
    ``[...]``."""
    x64 = x.to(torch.float16).double()
    qmax = _qmax(bits)
    scale = fp16_step(x64.abs().amax(dim=-1), qmax)
    safe = torch.where(scale > 0, scale.double(), torch.ones_like(x64[..., 0])).unsqueeze(-1)
    codes = torch.round(x64 / safe).clamp(-qmax, qmax) + (1 << (bits - 1))  # clamp never active
    return {"codes": pack_bits(codes.to(torch.uint8), bits), "scale": scale}


def decode_tokens(blocks: Blocks, bits: int) -> torch.Tensor:
    """FP32 ``[..., d]``: ``(code - 2^(b-1)) s``, exact."""
    codes = unpack_bits(blocks["codes"], bits).float() - (1 << (bits - 1))
    return codes * blocks["scale"].float().unsqueeze(-1)


def token_error(blocks: Blocks, bits: int) -> torch.Tensor:
    """FP32 ``[...]``: every channel of a token is within this of its original."""
    return (0.5 + 8 * FP32_EPS * _qmax(bits)) * blocks["scale"].float()


@dataclass
class _TokenSymmetric:
    """What the key and value codecs share: the width, its check, encode and decode."""

    bits: int = 8
    name: str = "smartkv"
    kind: ClassVar[str] = ""

    def __post_init__(self) -> None:
        check_bits(self.bits)

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, self.kind)

    def encode(self, x: torch.Tensor) -> Blocks:
        return encode_tokens(x, self.bits)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return decode_tokens(blocks, self.bits)

    def _layout(self, owner: type, group: int = 1) -> CodeLayout | None:
        """Codes offset by ``2^(b-1)``, one scale per token, no offset; the keys' channel bound
        ``(1/2 + 8u qmax) max_t s_t`` (:func:`token_error`)."""
        if not keeps(self, owner) or self.bits not in KERNEL_BITS:
            return None
        a = 0.5 + 8 * FP32_EPS * _qmax(self.bits)
        return CodeLayout(False, self.bits, 1 << (self.bits - 1), (a, 0.0), group,
                          token_scale=True)

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The scales as the kernels index a scale per token (the value kernel per group of
        the whole head dimension: a trailing unit axis); the offset, never read, the same."""
        scale = blocks["scale"] if self.kind == "key" else blocks["scale"].unsqueeze(-1)
        return {"codes": blocks["codes"], "scale": scale, "offset": scale}


@KEY_CODECS.register("token_symmetric")
@dataclass
class TokenSymmetricKeyCodec(_TokenSymmetric, KeyCodec):
    """Keys: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale`` FP16 ``[Hkv, n, B]``."""

    kind: ClassVar[str] = "key"

    def kernel_layout(self) -> CodeLayout | None:
        """Symmetric per-token codes (2, 3, 4 or 8 bits): see :class:`CodeLayout`."""
        return self._layout(TokenSymmetricKeyCodec)

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        worst = token_error(blocks, self.bits).amax(dim=-1, keepdim=True)  # [Hkv, n, 1]
        return worst.expand(*worst.shape[:-1], blocks["codes"].shape[-1] * 8 // self.bits)


@VALUE_CODECS.register("token_symmetric")
@dataclass
class TokenSymmetricValueCodec(_TokenSymmetric, ValueCodec):
    """Values: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale`` FP16 ``[Hkv, n, B]``."""

    kind: ClassVar[str] = "value"

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """Symmetric per-token codes (2, 3, 4 or 8 bits), one scale per token: a group of
        ``head_dim`` channels."""
        return self._layout(TokenSymmetricValueCodec, head_dim)

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        d = blocks["codes"].shape[-1] * 8 // self.bits
        return token_error(blocks, self.bits) * d**0.5 * (1 + 1e-6)
