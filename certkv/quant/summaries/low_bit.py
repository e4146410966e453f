"""Evicted keys kept at a very low width instead of dropped: ``bits``-bit per-channel affine
codes over the block (:class:`~certkv.quant.int8_channel.ChannelAffineKeyCodec`, the paper's
eq. 2-3 at 2 or 4 bits), values as the box summary's centre and radius.

Logits: each token is scored from its own codes, within the codec's deterministic ``Delta_b =
sum_c |q_c| (s_c / 2 + rounding)`` with ``s_c = (u_c - l_c) / (2^bits - 1)``: a third of the
box's half-range at 2 bits, a fifteenth at 4, and per token rather than one midpoint for all, so
the Phase-1 log-masses rank evicted blocks as the keys do. Values: the box's centre and radius.
Tier-1 per block and kv head: ``B d bits / 8`` bytes of codes, ``8 d`` of FP32 scale and offset,
``2 d + 4`` of values (900 bytes at d = 64, B = 16, 2 bits: about 56 bytes per token and kv
head; 1,156 at 4 bits).
"""

from __future__ import annotations

from dataclasses import dataclass

from certkv.quant.int8_channel import ChannelAffineKeyCodec
from certkv.quant.precision import Precision
from certkv.quant.summaries.base import Summary
from certkv.quant.summary import SummaryValueCodec
from certkv.registry import SUMMARIES


@dataclass(frozen=True)
class LowBitKeySummary(Summary):
    """``bits``-bit keys and the value radius (see the module)."""

    bits: int = 2

    def precision(self) -> Precision:
        return Precision(ChannelAffineKeyCodec(bits=self.bits), SummaryValueCodec(), "evicted")


@SUMMARIES.register("keys2")
def keys2() -> LowBitKeySummary:
    """2-bit keys, value radius."""
    return LowBitKeySummary(bits=2)


@SUMMARIES.register("keys4")
def keys4() -> LowBitKeySummary:
    """4-bit keys, value radius."""
    return LowBitKeySummary(bits=4)
