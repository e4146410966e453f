"""What Tier-1 keeps of an evicted block (``evict.summary``; issue 56): one summary per file,
found through :data:`certkv.registry.SUMMARIES`.

A summary is a :class:`~certkv.quant.precision.Precision` like any other, so it enters the
certificate through the codecs' own deterministic bounds (eq. 8's ``Delta_b`` from the key
codec's channel bound, Cor. 4.2's ``eta_b`` from the value codec's token bound) and the store
counts its bytes in the eviction budget. Summaries trade Tier-1 bytes per evicted token for
tighter logit bounds: the looser the bound, the more often the boundary check (eq. 18) fails
and the more of the evicted blocks a certified step pages back in.
"""

from certkv.quant.summaries.base import Summary
from certkv.quant.summaries.box import BoxSummary
from certkv.quant.summaries.low_bit import LowBitKeySummary

__all__ = ["BoxSummary", "LowBitKeySummary", "Summary"]
