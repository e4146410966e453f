"""Seed 004's rematerialisation as eviction by age (the oldest blocks leave first).

The seed evicts under memory pressure (usage above ``memory_threshold`` = 0.9) the tokens of
lowest recompute cost ``flops x (layer + 1) x 1 / (1 + age / 100)`` and keeps the newest
``min_materialized`` = 512 tokens materialised; within one layer that cost falls with age, so the
order is oldest first (NOTES_001-004: age, not position). "Recompute on access" is certkv's
page-in from Tier-2, decided per step by the certificate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.evict.base import EvictionPolicy
from certkv.registry import EVICTION_POLICIES


@EVICTION_POLICIES.register("age")
@dataclass
class AgeEviction(EvictionPolicy):
    """Evict the oldest blocks beyond the newest ``min_materialized`` tokens."""

    memory_threshold: float = 0.9
    min_materialized: int = 512
    name = "age"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.min_materialized, int) and self.min_materialized >= 0,
                ConfigError, f"evict.min_materialized={self.min_materialized!r} must be a "
                "non-negative number of tokens, e.g. 512.")

    def protected(self, store, tracker) -> torch.Tensor:
        return self.newest(store, self.min_materialized)

    def scores(self, store, tracker) -> torch.Tensor:
        return torch.arange(store.num_blocks, dtype=torch.float64)  # newer blocks are worth more
