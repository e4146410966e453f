"""StreamingLLM-style eviction: keep the attention sink and the most recent blocks.

The first ``sink`` tokens (the sink that attention keeps returning to) stay; of the rest the
newest blocks that fit the budget stay, so the kept window slides with the sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.evict.base import EvictionPolicy
from certkv.registry import EVICTION_POLICIES


@EVICTION_POLICIES.register("streaming")
@dataclass
class StreamingEviction(EvictionPolicy):
    """A sink of ``sink`` tokens plus a recent window as large as the budget allows."""

    sink: int = 4
    name = "streaming"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.sink, int) and self.sink >= 0, ConfigError,
                f"evict.sink={self.sink!r} must be a non-negative number of tokens, e.g. 4.")

    def protected(self, store, tracker) -> torch.Tensor:
        return self.first(store, self.sink)

    def scores(self, store, tracker) -> torch.Tensor:
        return torch.arange(store.num_blocks, dtype=torch.float64)
