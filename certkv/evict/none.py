"""No eviction: every completed block stays at its precision (the ``evict: none`` default)."""

from __future__ import annotations

from dataclasses import dataclass

from certkv.evict.base import EvictionPolicy
from certkv.registry import EVICTION_POLICIES


@EVICTION_POLICIES.register("none")
@dataclass
class NoEviction(EvictionPolicy):
    """Evicts nothing; the quantizer is left as it is."""

    budget: float = 1.0
    name = "none"

    @property
    def enabled(self) -> bool:
        return False
