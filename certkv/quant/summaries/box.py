"""The box summary (seed 004's rematerialisation; the default): per-channel key minimum and
maximum, value centre and radius (:mod:`certkv.quant.summary`).

Logits: every token of the block is scored at the box's midpoint ``m``, within ``Delta_b =
sum_c |q_c| (u_c - l_c) / 2`` of its true logit (eq. 8). Values: every token reads the centre
``c``, within the radius ``max_t ||v_t - c||`` (``eta_b``). Tier-1 per block and kv head:
``4 d`` bytes of keys and ``2 d + 4`` of values (388 bytes at d = 64, B = 16: about 24 bytes per
token and kv head against 96 for INT8 keys and INT4 values).
"""

from __future__ import annotations

from dataclasses import dataclass

from certkv.quant.precision import Precision
from certkv.quant.summaries.base import Summary
from certkv.quant.summary import SummaryKeyCodec, SummaryValueCodec
from certkv.registry import SUMMARIES


@SUMMARIES.register("box")
@dataclass(frozen=True)
class BoxSummary(Summary):
    """Per-channel key range and value radius (see the module)."""

    def precision(self) -> Precision:
        return Precision(SummaryKeyCodec(), SummaryValueCodec(), "evicted")
