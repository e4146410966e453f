"""InnerQ (seed 002, Sections 4.1-4.4): groups along the reduction dimension, hybrid modes.

InnerQ groups each operand of attention along the dimension its product reduces over, the
opposite of KIVI: keys **per token** in groups of ``G = 32`` consecutive channels (``q k^T``
reduces over channels), values **per channel** over a group of 32 consecutive tokens (``p V``
reduces over tokens; here the group is the block, so ``B <= 32``). Each group is quantized

* **asymmetric**: zero-point ``Z = min``, scale ``S >= (max - min) / (2^b - 1)``, codes
  ``q = round((x - Z) / S)``, ``x_hat = q S + Z``;
* **symmetric** (sign-magnitude): ``S >= max |x| / (2^b - 1)``, magnitudes ``m = round(|x| / S)``
  and one sign bit per element, ``x_hat = +-m S``;
* **hybrid**: both, keeping the one with the lower squared error over the group (ties go to
  symmetric), with a mode bit; ``hybrid_prefill``: hybrid for blocks quantized during the
  prefill (the layer's first append), symmetric for blocks quantized later in decode.

Storage per group is the seed's unified layout: ``G b`` code bits, an FP16 scale, one 32-bit slot
(the FP32 zero-point, or the ``G <= 32`` sign bits) and one mode bit (packed per block). Tier-1
bytes are these tensors' sizes, so every byte is counted.

**Key normalization** (Section 4.3). With ``normalize`` the keys of channel ``c`` are divided by
``2^e_c``, the power of two nearest ``sqrt(max_t |K[t, c]|)`` over the layer's prefill keys (the
store passes that maximum in :class:`~certkv.quant.base.LayerContext`; a direct :meth:`encode`
takes it over the blocks given), before grouping, and the query is multiplied by it at run time.
A power of two makes both exact: ``x / 2^e`` is exact in FP64 and FP32, and every product
``(q_c 2^e_c) k_hat_c / 2^e_c`` equals ``q_c k_hat_c`` bit for bit, so the logits are unchanged
in exact *and* in FP32 arithmetic. :meth:`InnerQKeyCodec.decode` therefore returns keys in the
original units (``2^e_c`` times the normalized reconstruction), which is the compensated query
folded into the key; the bound is stated in original units, so ``Delta_b = sum_c |q_c| r_c``
(paper eq. 8) bounds the logit error of the normalized keys with the compensated query. The
exponents are stored per block (one int8 per channel, counted in Tier-1 bytes). Exact windows
are left as they are: normalizing an FP16 block by a power of two and compensating the query
changes nothing.

**Bound.** Per element and group the reconstruction errs by at most ``r = (1/2 + 8u (2^b - 1)) S
+ 8u |Z|`` (``|Z|`` only for asymmetric groups; ``u = 2^-24``), the argument of
:mod:`certkv.quant.kivi`: the scale is rounded up to FP16 so nothing clips, the FP64 quotient is
within ``2^-53 (2^b - 1)`` of the exact one, and decode rounds once in FP32 (``q S`` is exact:
8 bits times 11). Symmetric decode ``+-m S`` is exact in FP32. A constant asymmetric group
(``S = 0``) decodes exactly. A key channel's bound over the block is the largest ``r`` of its
group over the block's tokens, times ``2^e_c``; a value token's l2 bound is
``sqrt(sum_c r_c^2)`` over its channels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import FP32_EPS, Blocks, KeyCodec, LayerContext, ValueCodec
from certkv.quant.kivi import fp16_step
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import (
    check_bits,
    check_packable,
    pack_bits,
    pack_flags,
    unpack_bits,
    unpack_flags,
)
from certkv.registry import KEY_CODECS, VALUE_CODECS

MODES = ("asym", "sym", "hybrid", "hybrid_prefill")
_FP_SLACK = 8 * FP32_EPS  # FP32 headroom relative to the reconstructed magnitude (KIVI's)
_SLOT_BITS = 32  # the unified slot: an FP32 zero-point or up to 32 sign bits
_EXPONENT_RANGE = (-12, 8)  # sqrt of |k| in [2^-24, 2^16): every FP16 key's norm exponent


class Groups(NamedTuple):
    """Quantized groups: ``codes`` uint8 ``[..., G]`` (unsigned codes, or magnitudes where
    symmetric), ``scale`` FP16 ``[...]``, ``slot`` int32 ``[...]`` (the FP32 zero-point's bits,
    or the sign word: bit ``i`` set where element ``i`` is negative) and ``sym`` bool ``[...]``."""

    codes: torch.Tensor
    scale: torch.Tensor
    slot: torch.Tensor
    sym: torch.Tensor


def _check_mode(mode: str) -> None:
    require(mode in MODES, ConfigError, f"mode={mode!r} is not an InnerQ mode; use one of {MODES}.")


def group_mode(mode: str, layer: LayerContext | None) -> str:
    """``asym``, ``sym`` or ``hybrid`` for blocks quantized in ``layer``'s current phase."""
    if mode == "hybrid_prefill":
        return "hybrid" if layer is not None and layer.prefill else "sym"
    return mode


def _sign_word(negative: torch.Tensor) -> torch.Tensor:
    """Booleans ``[..., G]`` (``G <= 32``) -> int32 ``[...]`` with bit ``i`` = element ``i``."""
    shifts = torch.arange(negative.shape[-1], dtype=torch.int64, device=negative.device)
    word = (negative.to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)


def _negative(slot: torch.Tensor, size: int) -> torch.Tensor:
    """Inverse of :func:`_sign_word`: int32 ``[...]`` -> booleans ``[..., size]``."""
    shifts = torch.arange(size, dtype=torch.int64, device=slot.device)
    return ((slot.to(torch.int64).unsqueeze(-1) >> shifts) & 1).bool()


def quantize_groups(x: torch.Tensor, bits: int, mode: str) -> Groups:
    """Quantize FP64 groups ``x [..., G]`` (exact multiples of FP16 numbers by powers of two) in
    ``mode`` (``asym``, ``sym`` or ``hybrid``: the lower squared error, ties to symmetric)."""
    levels = (1 << bits) - 1
    lo = x.amin(dim=-1)
    asym_scale = fp16_step(x.amax(dim=-1) - lo, levels)
    safe = torch.where(asym_scale > 0, asym_scale.double(), torch.ones_like(lo)).unsqueeze(-1)
    asym_codes = torch.round((x - lo.unsqueeze(-1)) / safe).clamp(0, levels)  # never active
    asym_err = (asym_codes * asym_scale.double().unsqueeze(-1) + lo.unsqueeze(-1) - x)

    sym_scale = fp16_step(x.abs().amax(dim=-1), levels)
    safe = torch.where(sym_scale > 0, sym_scale.double(), torch.ones_like(lo)).unsqueeze(-1)
    magnitude = torch.round(x.abs() / safe).clamp(0, levels)  # never active
    sym_err = torch.copysign(magnitude * sym_scale.double().unsqueeze(-1), x) - x

    if mode == "hybrid":
        sym = sym_err.square().sum(dim=-1) <= asym_err.square().sum(dim=-1)
    else:
        sym = torch.full_like(lo, mode == "sym", dtype=torch.bool)
    zero_bits = lo.float().view(torch.int32)  # exact: lo is an FP16 number times 2^-e
    return Groups(
        codes=torch.where(sym.unsqueeze(-1), magnitude, asym_codes).to(torch.uint8),
        scale=torch.where(sym, sym_scale, asym_scale),
        slot=torch.where(sym, _sign_word(x < 0), zero_bits),
        sym=sym,
    )


def decode_groups(groups: Groups) -> torch.Tensor:
    """FP32 ``[..., G]``: ``q S + Z`` (asymmetric) or ``+-m S`` (symmetric, exact)."""
    scale = groups.scale.float().unsqueeze(-1)
    values = groups.codes.float() * scale
    asym = values + groups.slot.view(torch.float32).unsqueeze(-1)
    sym = torch.where(_negative(groups.slot, groups.codes.shape[-1]), -values, values)
    return torch.where(groups.sym.unsqueeze(-1), sym, asym)


def _zero_magnitude(groups: Groups) -> torch.Tensor:
    """``|Z|`` FP32 ``[...]`` of asymmetric groups, 0 for symmetric ones."""
    zero = groups.slot.view(torch.float32).abs()
    return torch.where(groups.sym, torch.zeros_like(zero), zero)


def _bound_coefficients(bits: int) -> tuple[float, float]:
    """``(a, b)`` of :func:`group_bound`'s ``r = a S + b |Z|``."""
    return 0.5 + _FP_SLACK * ((1 << bits) - 1), _FP_SLACK


def group_bound(groups: Groups, bits: int) -> torch.Tensor:
    """FP32 ``[...]``: every element of a group is within this of its original (module
    docstring); 0 for a constant asymmetric group."""
    scale = groups.scale.float()
    a, b = _bound_coefficients(bits)
    bound = a * scale + b * _zero_magnitude(groups)
    return torch.where(scale > 0, bound, torch.zeros_like(bound))


def group_slack(groups: Groups, bits: int) -> torch.Tensor:
    """FP32 ``[...]``: any FP32 evaluation of :func:`decode_groups` is within this of it
    (``q S + Z`` rounds once: ``8u ((2^b - 1) S + |Z|)`` also covers two evaluations and this
    bound's own rounding, as in KIVI; symmetric decode is exact)."""
    scale = groups.scale.float()
    slack = _FP_SLACK * (((1 << bits) - 1) * scale + _zero_magnitude(groups))
    return torch.where((scale > 0) & ~groups.sym, slack, torch.zeros_like(slack))


def key_exponents(key_max: torch.Tensor) -> torch.Tensor:
    """InnerQ's key norm ``sqrt(max_t |K[t, c]|)`` as the nearest power of two: int8 exponents
    ``e_c`` of FP32 channel maxima ``[..., d]`` (0 for an all-zero channel)."""
    exponent = torch.round(torch.log2(key_max.double()) / 2)
    exponent = torch.where(key_max > 0, exponent, torch.zeros_like(exponent))
    return exponent.clamp(*_EXPONENT_RANGE).to(torch.int8)


def _powers(exponents: torch.Tensor) -> torch.Tensor:
    return torch.exp2(exponents.float())


@KEY_CODECS.register("innerq")
@dataclass
class InnerQKeyCodec(KeyCodec):
    """Keys per token in groups of ``group`` consecutive channels, ``bits`` in {2, 3, 4, 8}.

    Stored per block: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale`` FP16 and
    ``slot`` int32 ``[Hkv, n, B, d / group]``, ``mode`` (symmetric flags of the ``B d / group``
    groups, packed) uint8 ``[Hkv, n, ceil(B d / group / 8)]`` and, with ``normalize``, ``norm``
    int8 ``[Hkv, n, d]`` (the channel exponents ``e_c``, raised in a block whose keys would
    otherwise leave the FP16 range of the scales).
    """

    bits: int = 2
    group: int = 32
    mode: str = "hybrid"
    normalize: bool = True
    name: str = "innerq"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        _check_mode(self.mode)
        require(isinstance(self.group, int) and 1 <= self.group <= _SLOT_BITS, ConfigError,
                f"group={self.group!r} must be 1-{_SLOT_BITS} channels (a group's signs share "
                "one 32-bit word), e.g. 32.")

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "key")
        require(head_dim % self.group == 0, ConfigError,
                f"InnerQ key group={self.group} does not divide head_dim={head_dim}; use a "
                "divisor of head_dim, e.g. group=32 (or 16, 8).")

    def encode(self, k: torch.Tensor) -> Blocks:
        return self.encode_at(k, torch.zeros(k.shape[1], dtype=torch.long))

    def encode_at(self, k: torch.Tensor, start: torch.Tensor,
                  layer: LayerContext | None = None) -> Blocks:
        hkv, n, block, d = k.shape
        x = k.to(torch.float16).double()
        blocks: Blocks = {}
        if self.normalize:
            exponents = self._block_exponents(x, layer)  # [Hkv, n, d]
            x = x / torch.exp2(exponents.double()).unsqueeze(2)  # exact
            blocks["norm"] = exponents
        groups = quantize_groups(x.reshape(hkv, n, block, d // self.group, self.group),
                                 self.bits, group_mode(self.mode, layer))
        blocks.update(codes=pack_bits(groups.codes.reshape(hkv, n, block, d), self.bits),
                      scale=groups.scale, slot=groups.slot,
                      mode=pack_flags(groups.sym.reshape(hkv, n, block * d // self.group)))
        return blocks

    @staticmethod
    def _block_exponents(x: torch.Tensor, layer: LayerContext | None) -> torch.Tensor:
        """The channel exponents ``[Hkv, n, d]`` of FP64 keys ``x [Hkv, n, B, d]``: of the
        layer's prefill maximum when the store has one, else of the blocks being encoded;
        raised where a block's keys would exceed ``2^15`` after dividing (a later key much
        larger than the prefill's), so every scale stays in the FP16 range."""
        hkv, n, _, d = x.shape
        if not n:
            return torch.zeros(hkv, 0, d, dtype=torch.int8, device=x.device)
        if layer is not None and layer.key_max is not None:
            layer_max = layer.key_max.to(device=x.device, dtype=torch.float64)
        else:
            layer_max = x.abs().amax(dim=(1, 2))
        block_max = x.abs().amax(dim=2).clamp_min(2.0**-24)  # [Hkv, n, d]
        floor = torch.ceil(torch.log2(block_max)) - 15
        return torch.maximum(key_exponents(layer_max).unsqueeze(1).double(), floor).to(torch.int8)

    def kernel_layout(self) -> CodeLayout | None:
        """Groups of ``group`` channels per token, 2, 3, 4 or 8 bits, with the channel
        exponents where normalized (:class:`CodeLayout`'s ``inner``); the bound's ``(a, b)``
        are :func:`group_bound`'s."""
        if not keeps(self, InnerQKeyCodec) or self.bits not in KERNEL_BITS:
            return None
        return CodeLayout(False, self.bits, 0, _bound_coefficients(self.bits), self.group,
                          inner=True, norm=self.normalize)

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored tensors as they are (views): the slot is the kernels' ``offset``."""
        return {**blocks, "offset": blocks["slot"]}

    def groups(self, blocks: Blocks) -> Groups:
        """The stored groups: codes ``[Hkv, n, B, d / group, group]``, the rest ``[Hkv, n, B,
        d / group]``."""
        scale = blocks["scale"]
        codes = unpack_bits(blocks["codes"], self.bits)
        codes = codes.reshape(*scale.shape, self.group)
        sym = unpack_flags(blocks["mode"], scale.shape[2] * scale.shape[3]).reshape(scale.shape)
        return Groups(codes, scale, blocks["slot"], sym)

    def _per_channel(self, per_group: torch.Tensor, blocks: Blocks) -> torch.Tensor:
        """``[Hkv, n, B, d / group]`` -> the channel maximum over the block's tokens ``[Hkv, n,
        d]``, in original units (times ``2^e_c``)."""
        channel = per_group.repeat_interleave(self.group, dim=-1).amax(dim=2)
        return channel * _powers(blocks["norm"]) if "norm" in blocks else channel

    def decode(self, blocks: Blocks) -> torch.Tensor:
        groups = self.groups(blocks)
        keys = decode_groups(groups).flatten(-2)  # [Hkv, n, B, d]
        return keys * _powers(blocks["norm"]).unsqueeze(2) if "norm" in blocks else keys

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        return self._per_channel(group_bound(self.groups(blocks), self.bits), blocks)

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        return self._per_channel(group_slack(self.groups(blocks), self.bits), blocks)


@VALUE_CODECS.register("innerq")
@dataclass
class InnerQValueCodec(ValueCodec):
    """Values per channel over the block's ``B <= 32`` tokens, ``bits`` in {2, 3, 4, 8}.

    Stored per block: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]`` (packed along channels, as
    every value codec), ``scale`` FP16 and ``slot`` int32 ``[Hkv, n, d]``, ``mode`` uint8
    ``[Hkv, n, ceil(d / 8)]``.
    """

    bits: int = 2
    mode: str = "hybrid"
    name: str = "innerq"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        _check_mode(self.mode)

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "value")
        require(block_size <= _SLOT_BITS, ConfigError,
                f"InnerQ values are grouped over a block's tokens with their signs in one "
                f"32-bit word, but block_size={block_size}; use block_size=32 (or less).")

    def encode(self, v: torch.Tensor) -> Blocks:
        return self.encode_at(v)

    def encode_at(self, v: torch.Tensor, layer: LayerContext | None = None) -> Blocks:
        x = v.to(torch.float16).double().transpose(-1, -2)  # [Hkv, n, d, B]
        groups = quantize_groups(x, self.bits, group_mode(self.mode, layer))
        return {"codes": pack_bits(groups.codes.transpose(-1, -2), self.bits),
                "scale": groups.scale, "slot": groups.slot, "mode": pack_flags(groups.sym)}

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """Groups of the block's tokens per channel, 2, 3, 4 or 8 bits (:class:`CodeLayout`'s
        ``inner``)."""
        if not keeps(self, InnerQValueCodec) or self.bits not in KERNEL_BITS:
            return None
        return CodeLayout(False, self.bits, 0, _bound_coefficients(self.bits), inner=True)

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored tensors as they are (views): the slot is the kernels' ``offset``."""
        return {**blocks, "offset": blocks["slot"]}

    def groups(self, blocks: Blocks) -> Groups:
        """The stored groups: codes ``[Hkv, n, d, B]``, the rest ``[Hkv, n, d]``."""
        scale = blocks["scale"]
        codes = unpack_bits(blocks["codes"], self.bits).transpose(-1, -2)
        sym = unpack_flags(blocks["mode"], scale.shape[-1])
        return Groups(codes, scale, blocks["slot"], sym)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return decode_groups(self.groups(blocks)).transpose(-1, -2)

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        channel = group_bound(self.groups(blocks), self.bits)  # [Hkv, n, d]
        token = torch.sqrt(channel.square().sum(dim=-1)) * (1 + 1e-5)
        return token.unsqueeze(-1).expand(*token.shape, blocks["codes"].shape[2])

    def decode_rounding(self, head_dim: int | None = None) -> float:
        """Asymmetric decode ``q S + Z`` rounds once; two evaluations differ by ``2u |q S + Z|
        <= 2u ((2^b - 1) S + |Z|)`` per element, with ``(2^b - 1) S <= 2 M_c (1 + 2^-9) +
        (2^b - 1) 2^-24`` and ``|Z| <= M_c`` (``M_c = max_t |v_tc|`` over the block, the scale
        rounded up to FP16). In l2 over channels ``sqrt(sum_c M_c^2) <= sqrt(B) max_t ||v_t||``
        with ``B <= 32``: ``c = max(2 * 3.004 sqrt(32) (1 + u), 2.01 (2^b - 1)) <= max(34.1,
        2.01 (2^b - 1))``. Symmetric decode is exact."""
        return max(34.1, 2.01 * ((1 << self.bits) - 1))
