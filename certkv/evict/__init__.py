"""Eviction policies (the ``evict`` config group; issue 23): which completed blocks leave
Tier-1, keeping a certified summary (:mod:`certkv.evict.base`)."""

from certkv.evict.age import AgeEviction
from certkv.evict.base import EvictionPolicy
from certkv.evict.heavy_hitter import HeavyHitterEviction
from certkv.evict.none import NoEviction
from certkv.evict.snapkv import SnapKVEviction
from certkv.evict.streaming import StreamingEviction
from certkv.evict.tracker import EvictionTracker

__all__ = ["AgeEviction", "EvictionPolicy", "EvictionTracker", "HeavyHitterEviction",
           "NoEviction", "SnapKVEviction", "StreamingEviction"]
