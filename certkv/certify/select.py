"""Adaptive top-K* selection of FP16-key blocks (paper 3.3, Algorithm 1; per-KV-group union 9.9).

All tensors are per query head: block masses ``p: [Hq, n]`` (normalised Phase-1 masses over every
block, the exact FP16 tail block included) and ``quantized: [n]`` (False for the exact tail block).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.registry import SELECTORS, inherits

RANKS = ("mass", "upper")


def rank_blocks(p: torch.Tensor, quantized: torch.Tensor) -> torch.Tensor:
    """Block indices ``[Hq, n]`` by descending mass, quantized blocks first (stable order)."""
    key = torch.where(quantized, p, -1.0)
    return torch.sort(key, dim=-1, descending=True, stable=True).indices


def coverage_k(p: torch.Tensor, quantized: torch.Tensor, order: torch.Tensor, tau_cov: float,
               n_quantized: int | torch.Tensor):
    """Smallest ``K`` with ``C_K >= tau_cov`` (paper 3.3 step 3), per head: ``[Hq]`` int64.

    Coverage counts the exact (non-quantized) mass as already covered, then adds quantized
    blocks in rank order (the ``n_quantized`` quantized blocks rank first); a block is needed
    while the mass covered before it is below target. ``n_quantized`` a host int slices the
    order; a 0-d device tensor (no host read: a step captured in a graph) masks the blocks
    ranked after the quantized ones instead (the same ``K``).
    """
    total = p.sum(dim=-1, keepdim=True)
    exact = p.masked_fill(quantized, 0.0).sum(dim=-1, keepdim=True)
    if isinstance(n_quantized, torch.Tensor):
        lossy = quantized[order]  # True on the first n_quantized of each order
        ranked = p.gather(-1, order) * lossy
        before = exact + ranked.cumsum(dim=-1) - ranked
        return ((before < tau_cov * total) & lossy).sum(dim=-1)
    ranked = p.gather(-1, order[:, :n_quantized])
    before = exact + ranked.cumsum(dim=-1) - ranked
    return (before < tau_cov * total).sum(dim=-1)


def mask_top(rank: torch.Tensor, k: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """Boolean ``[Hq, n]``: each head's blocks of rank below ``k[h]`` (``rank [Hq, n]``: a
    block's position in the head's order) plus the ``exact [n]`` ones."""
    return (rank < k.unsqueeze(-1)) | exact


def union_by_kv_group(mask: torch.Tensor, group: int) -> torch.Tensor:
    """Per-KV-group union of FP16 sets (paper 9.9): ``[Hq, n] -> [Hq, n]``, GQA group ``G``."""
    hq, n = mask.shape
    union = mask.reshape(hq // group, group, n).any(dim=1, keepdim=True)
    return union.expand(-1, group, -1).reshape(hq, n)


class Selector:
    """Base of selectors: which blocks a step promotes to FP16 keys (paper 3.3). The step asks
    a selector what it can do (:meth:`fuses_on_cpu`), never its type."""

    def fuses_on_cpu(self) -> bool:
        """Whether :mod:`certkv.certify.fused_select` computes this selector's choice."""
        return False


@SELECTORS.register("adaptive_topk")
@dataclass
class AdaptiveTopK(Selector):
    """Promote the fewest blocks whose INT8-estimated mass reaches ``tau_cov`` (Table 2 defaults).

    Args:
        tau_cov: coverage threshold.
        k_min: minimum promoted blocks per head.
        k_max: maximum promoted blocks per head (before Rung-1 expansion).
        mass_inflation: exponent ``c`` of ``e^{c Delta}`` in the tail-mass bound: 2 (tight,
            Theorem 4.4) or 3 (the paper's implementation, INT8 x INT8 scoring headroom).
        kv_group_union: share one FP16 set per KV group (union of its query heads' sets).
        rank: promotion order: ``"mass"`` (the paper: INT8-estimated mass ``p_hat_b``) or
            ``"upper"`` (its upper bound ``p_hat_b e^{Delta_b}``, so that in a store of mixed
            precisions the wide blocks whose bound could reach the top are promoted first and
            the boundary check, eq. 18, can pass; the same as ``"mass"`` where every block has
            the same ``Delta_b``).
    """

    tau_cov: float = 0.995
    k_min: int = 2
    k_max: int = 128
    mass_inflation: float = 3.0
    kv_group_union: bool = False
    rank: str = "mass"

    def __post_init__(self) -> None:
        require(0.0 <= self.tau_cov <= 1.0, ConfigError,
                f"tau_cov={self.tau_cov} must lie in [0, 1], e.g. 0.995.")
        require(self.k_min >= 0, ConfigError, f"k_min={self.k_min} must be >= 0, e.g. 2.")
        require(self.k_max >= 0, ConfigError,
                f"k_max={self.k_max} must be >= 0 (FP16 key blocks per head), e.g. 128.")
        require(self.k_min <= self.k_max, ConfigError,
                f"k_min={self.k_min} exceeds k_max={self.k_max}; raise k_max or lower k_min.")
        require(self.mass_inflation >= 2.0, ConfigError,
                f"mass_inflation={self.mass_inflation} would not bound the tail mass; use 2 or 3.")
        require(self.rank in RANKS, ConfigError,
                f"selector.rank={self.rank!r} is unknown; use one of {list(RANKS)}.")

    def fuses_on_cpu(self) -> bool:
        """Whether the CPU's fused selection (:mod:`certkv.certify.fused_select`) computes this
        selector's choice: the paper's mass ranking, per query head, with these methods."""
        return (inherits(self, AdaptiveTopK, "order", "choose_k", "promoted")
                and self.rank == "mass" and not self.kv_group_union)

    def order(self, p: torch.Tensor, delta_b: torch.Tensor, quantized: torch.Tensor):
        """Block indices ``[Hq, n]`` in promotion order (:attr:`rank`; quantized first)."""
        if self.rank == "mass":
            return rank_blocks(p, quantized)
        upper = torch.where(p > 0, p * torch.exp(delta_b.clamp(max=80.0)), 0.0)
        return rank_blocks(upper, quantized)

    def choose_k(self, p: torch.Tensor, quantized: torch.Tensor, order: torch.Tensor,
                 n_quantized: int | torch.Tensor | None = None):
        """``K* = clamp(min{K : C_K >= tau_cov}, K_min, K_max)``, at most the quantized count
        (pass ``n_quantized``, a host int or a 0-d device tensor, to avoid a device sync)."""
        if n_quantized is None:
            n_quantized = int(quantized.sum())
        k = coverage_k(p, quantized, order, self.tau_cov, n_quantized)
        if isinstance(n_quantized, torch.Tensor):
            return torch.minimum(k.clamp(self.k_min, self.k_max), n_quantized)
        return k.clamp(self.k_min, min(self.k_max, n_quantized))

    @staticmethod
    def ranks(order: torch.Tensor) -> torch.Tensor:
        """Each block's position ``[Hq, n]`` in its head's ``order`` (the inverse permutation)."""
        return order.argsort(dim=-1)

    def promoted(self, rank: torch.Tensor, k: torch.Tensor, exact: torch.Tensor, group: int):
        """FP16-key mask ``[Hq, n]``: blocks of rank below ``k`` and the exact ones (union per KV
        group if configured); ``rank`` from :meth:`ranks`."""
        mask = mask_top(rank, k, exact)
        return union_by_kv_group(mask, group) if self.kv_group_union else mask
