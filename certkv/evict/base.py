"""EvictionPolicy: which completed blocks leave Tier-1 under a byte budget (issue 23).

An evicted block keeps only its summary in Tier-1 (:mod:`certkv.quant.summaries`: by default
the per-channel key minimum and maximum, value centre and radius), so the certificate still
covers it: its logits lie within ``Delta_b`` (eq. 8, from the summary's key bound) and its values
within ``eta_b`` (the radius) of what the step reads. The ladder pages it back in from Tier-2
(its FP16 originals never leave host memory) when its bound matters, or goes dense; nothing in
the certificate changes for eviction.

A policy only ranks blocks: :meth:`protected` (never evicted) and :meth:`scores` (kept in
descending order while the budget allows); :class:`~certkv.evict.tracker.EvictionTracker` does
the byte accounting and moves blocks between their precision and the summary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from certkv.errors import ConfigError, require
from certkv.quant.precision import Precision
from certkv.registry import SUMMARIES


@dataclass
class EvictionPolicy:
    """Base of the ``evict`` config group.

    Args:
        budget: Tier-1 bytes of the completed blocks (codes, metadata, exact windows and
            summaries; :meth:`TieredKVStore.tier1_bytes`) as a fraction of their dense FP16
            bytes; never exceeded after a step.
        memory_threshold: eviction starts above ``memory_threshold * budget`` and brings Tier-1
            back down to it (seed 004's 0.9 leaves room before the next eviction).
        summary: what Tier-1 keeps of an evicted block, a name in
            :data:`~certkv.registry.SUMMARIES` (:mod:`certkv.quant.summaries`: ``box``, the
            per-channel key range; ``keys2`` / ``keys4``, the keys at 2 or 4 bits), counted in
            the budget.
    """

    budget: float = 0.5
    memory_threshold: float = 1.0
    summary: str = "box"
    name: ClassVar[str] = "base"
    restores: ClassVar[bool] = False  # may an evicted block come back (re-encoded from Tier-2)?

    def __post_init__(self) -> None:
        require(isinstance(self.budget, (int, float)) and 0 < self.budget <= 1, ConfigError,
                f"evict.budget={self.budget!r} must be a fraction in (0, 1] of the dense FP16 "
                "bytes (1 keeps every block), e.g. 0.25.")
        require(isinstance(self.memory_threshold, (int, float))
                and 0 < self.memory_threshold <= 1, ConfigError,
                f"evict.memory_threshold={self.memory_threshold!r} must be in (0, 1], e.g. 0.9.")
        SUMMARIES.get(self.summary, "evict.summary")  # an unknown name: one sentence, now

    def summary_precision(self) -> Precision:
        """The precision evicted blocks are held at: :attr:`summary`'s."""
        return SUMMARIES.get(self.summary, "evict.summary")().precision()

    @property
    def enabled(self) -> bool:
        return True

    @property
    def prompt_window(self) -> int:
        """How many of the prompt's last queries this policy ranks blocks by (0: none)."""
        return 0

    def protected(self, store, tracker) -> torch.Tensor:
        """Bool ``[n_blocks]`` (host): blocks this policy never evicts (``tracker``: the layer's
        :class:`~certkv.evict.tracker.EvictionTracker`)."""
        return torch.zeros(store.num_blocks, dtype=torch.bool)

    def scores(self, store, tracker) -> torch.Tensor:
        """FP64 ``[n_blocks]`` (host): what keeping each block is worth; the highest are kept."""
        raise NotImplementedError

    def prompt_scores(self, store, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """FP64 ``[n_blocks]``: what the prompt's ``queries [Hq, T, d]`` say each block is worth
        (policies with a :attr:`prompt_window`)."""
        raise NotImplementedError

    def tracker(self, store):
        from certkv.evict.tracker import EvictionTracker

        return EvictionTracker(self, store)

    def newest(self, store, tokens: int) -> torch.Tensor:
        """Bool ``[n_blocks]``: blocks holding one of the newest ``tokens`` tokens."""
        end = (torch.arange(store.num_blocks) + 1) * store.block_size
        return end > store.num_tokens - tokens

    def first(self, store, tokens: int) -> torch.Tensor:
        """Bool ``[n_blocks]``: blocks holding one of the first ``tokens`` tokens."""
        return torch.arange(store.num_blocks) * store.block_size < tokens

    @property
    def label(self) -> str:
        return f"{self.name}@{self.budget:g}"
