"""H2O-style heavy hitters: keep the blocks that have received the most attention so far.

The score of a block is its attention mass summed over the decode steps seen, averaged over
query heads (Phase 2's ``rho_b``, which the certified step computes anyway; no extra pass).
The newest ``recent`` tokens always stay. A block's score keeps growing while it is evicted
(the step still attends to it through its summary or a page-in), so a block that becomes heavy
comes back: it is re-encoded from its FP16 originals at its own precision.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.evict.base import EvictionPolicy
from certkv.registry import EVICTION_POLICIES


@EVICTION_POLICIES.register("heavy_hitter")
@dataclass
class HeavyHitterEviction(EvictionPolicy):
    """Keep the newest ``recent`` tokens and the heaviest blocks; evicted blocks may return."""

    recent: int = 64
    name = "heavy_hitter"
    restores = True

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.recent, int) and self.recent >= 0, ConfigError,
                f"evict.recent={self.recent!r} must be a non-negative number of tokens, e.g. 64.")

    def protected(self, store, tracker) -> torch.Tensor:
        return self.newest(store, self.recent)

    def scores(self, store, tracker) -> torch.Tensor:
        # ties (no step seen yet, e.g. right after prefill) go to the newer block
        order = torch.arange(store.num_blocks, dtype=torch.float64) * 1e-12
        return tracker.mass.double().cpu() + order
