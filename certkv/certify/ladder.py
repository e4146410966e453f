"""The fallback ladder (paper 3.4) and its monitors' settings (Section 6).

Rung 1 expands K*; rung 2 is value promotion (the value policy); rung 3 replaces a head that
fails the ranking or boundary check with dense attention on its FP16 originals; rung 4 replaces the
whole layer (score canary violated, non-finite output, or too many heads on rung 3). With a bound
tolerance (``bound_tol`` / ``bound_rtol``) a head whose bound exceeds it climbs the same ladder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.registry import LADDERS

TAIL_MASS = ("tight", "paper")


@LADDERS.register("paper")
@dataclass
class Ladder:
    """Escalation policy and monitor settings (Table 2 defaults).

    Args:
        expand: enable rung 1.
        expand_factor: rung 1 multiplies K* by this ("e.g. double it").
        k_max: cap on K* after rung 1; ``None`` means twice the selector's ``k_max``
            (the paper's effective promoted set is usually ``2 K_max``, 9.8).
        e_key_tol: also expand when the candidate E_key exceeds this (``None``: only when the
            certified tail mass ``e^{c Delta} alpha_hat`` misses ``1 - tau_cov``).
        r: ranking-consistency depth (eq. 17-18).
        ranking_check: enable the rung-3 ranking check (eq. 17).
        boundary_check: enable the rung-3 boundary check (eq. 18).
        canary: score-consistency canary on every block scored both ways (rung 4 on violation).
        eps_guard: numerical guard of the canary and boundary comparisons.
        exploration: fraction of tail blocks promoted at random for canary spot checks.
        layer_dense_fraction: rung 4 once this fraction of heads needs rung 3.
        seed: seed of the exploration draw.
        bound_tol: a guarantee the user sets (``None`` by default, as ``bound_rtol``: the
            paper's behaviour): a head whose returned bound exceeds ``bound_tol + bound_rtol *
            ||out_h||`` escalates (the widest key set, then FP16 values for its promoted
            blocks, then dense attention), so every head is within it or dense.
        bound_rtol: the part of that guarantee relative to the head's output norm.
        tail_mass: how rung 1 bounds the mass left on INT8 keys: ``tight`` (default:
            ``min(1, e^{Delta_F} alpha_hat)``, the Phase-2 tail mass, ``Delta_F`` the largest
            ``Delta_b`` of the promoted blocks, and the per-block TV bound for E_key) or
            ``paper`` (eq. 14's ``e^{c Delta} alpha_hat`` and eq. 15, for reproduction).
        page_in_budget: targeted page-in on stores with evicted blocks
            (:mod:`certkv.certify.targeted`): a head whose boundary check (eq. 18) fails reads
            the FP16 keys and values of the blocks that break it and is checked again before
            rung 3, at most this many new (kv head, block) pairs per layer step (``None``: no
            cap; 0, the default: off, the paper's rung 3 at once). Host path only (the torch
            and numba backends): the device path goes to rung 3.
        tol_page_in: with a bound tolerance, a head over it first reads (FP16 keys and values)
            the fewest blocks whose share of its bound, left out, brings the rest within half
            of what its tolerance leaves beside E_arith, the largest shares first
            (:func:`~certkv.certify.targeted.tolerance_plan`), and only then climbs to the
            widest key set, FP16 values and dense attention (``False``, the default: at once).
            With an absolute ``bound_tol`` the first pass already reads what the same plan
            picks from the Phase-1 masses. Its reads count in the certificate's ``targeted``
            pairs.
        rank_summaries: on stores with evicted blocks, what eq. 17 compares for a promoted
            block held at its Tier-1 summary: its summary's estimate, as a code's (``True``,
            the default), or its FP16 log-mass in both rankings (``False``): the block was
            read from Tier-2 whole, and its summary claims an interval of logits, which eq. 18
            checks while the block stays unread, not an order. Code-scored blocks are ranked
            as before; the certificate's bound does not depend on it (rungs 3-4 are monitors).
    """

    expand: bool = True
    expand_factor: float = 2.0
    k_max: int | None = None
    e_key_tol: float | None = None
    r: int = 1
    ranking_check: bool = True
    boundary_check: bool = True
    canary: bool = True
    eps_guard: float = 1e-6
    exploration: float = 0.0
    layer_dense_fraction: float = 1.0
    seed: int = 0
    tail_mass: str = "tight"
    bound_tol: float | None = None
    bound_rtol: float | None = None
    page_in_budget: int | None = 0
    tol_page_in: bool = False
    rank_summaries: bool = True

    def __post_init__(self) -> None:
        require(self.tail_mass in TAIL_MASS, ConfigError,
                f"ladder.tail_mass={self.tail_mass!r} is unknown; use 'tight' or 'paper'.")
        require(self.expand_factor >= 1.0, ConfigError,
                f"expand_factor={self.expand_factor} must be >= 1, e.g. 2.")
        require(self.k_max is None or self.k_max >= 0, ConfigError,
                f"ladder k_max={self.k_max} must be >= 0 or null.")
        require(self.r >= 1, ConfigError, f"r={self.r} must be a positive integer, e.g. 1.")
        require(0.0 <= self.exploration <= 1.0, ConfigError,
                f"exploration={self.exploration} must lie in [0, 1], e.g. 0.02.")
        require(0.0 < self.layer_dense_fraction <= 1.0, ConfigError,
                f"layer_dense_fraction={self.layer_dense_fraction} must lie in (0, 1].")
        require(self.eps_guard >= 0, ConfigError, f"eps_guard={self.eps_guard} must be >= 0.")
        for name in ("bound_tol", "bound_rtol"):
            value = getattr(self, name)
            require(value is None or (math.isfinite(value) and value >= 0), ConfigError,
                    f"ladder.{name}={value} must be a finite number >= 0 or null (off), e.g. "
                    f"ladder.{name}=0.05.")
        budget = self.page_in_budget
        require(budget is None or (isinstance(budget, int) and not isinstance(budget, bool)
                                   and budget >= 0), ConfigError,
                f"ladder.page_in_budget={self.page_in_budget!r} must be a whole number of "
                "(kv head, block) pairs >= 0 (0: off) or null (no cap), e.g. 64.")
        for name in ("tol_page_in", "rank_summaries"):
            require(isinstance(getattr(self, name), bool), ConfigError,
                    f"ladder.{name}={getattr(self, name)!r} must be true or false.")
        self._generators: dict[str, torch.Generator] = {}

    def exploration_draw(self, shape: tuple[int, ...], device: torch.device | str):
        """Uniform draw ``shape`` for the exploration spot checks, or None when exploration is
        off. Drawn on ``device`` from a generator seeded with ``seed`` (no host round-trip)."""
        if self.exploration <= 0:
            return None
        key = str(torch.device(device))
        if key not in self._generators:
            self._generators[key] = torch.Generator(device=key).manual_seed(self.seed)
        return torch.rand(shape, generator=self._generators[key], device=key)

    @property
    def bound_tolerance(self) -> bool:
        """Whether a bound tolerance is set (``bound_tol`` or ``bound_rtol``)."""
        return self.bound_tol is not None or self.bound_rtol is not None

    def tolerance(self, out_norm: torch.Tensor) -> torch.Tensor:
        """FP64 ``[Hq]``: each head's tolerance ``bound_tol + bound_rtol * ||out_h||``."""
        return (self.bound_tol or 0.0) + (self.bound_rtol or 0.0) * out_norm.double()

    def over_tolerance(self, bound: torch.Tensor, out_norm: torch.Tensor) -> torch.Tensor:
        """Heads ``[Hq]`` whose ``bound`` exceeds :meth:`tolerance` (a non-finite bound
        exceeds every tolerance)."""
        return ~(bound.double() <= self.tolerance(out_norm))

    def key_cap(self, selector_k_max: int, n_quantized: int | torch.Tensor) -> int | torch.Tensor:
        """The most blocks rung 1 may read with FP16 keys: ``k_max`` or ``2 K_max``, at most
        ``n_quantized`` (a host int, or a 0-d device tensor: then a tensor)."""
        cap = 2 * selector_k_max if self.k_max is None else self.k_max
        if isinstance(n_quantized, torch.Tensor):
            return n_quantized.clamp(max=cap)
        return min(cap, n_quantized)

    def needs_expansion(
        self, tail_bound: torch.Tensor, tau_cov: float, e_key: torch.Tensor
    ) -> torch.Tensor:
        """Rung 1 trigger per head: the certified tail mass misses ``1 - tau_cov`` (or E_key is
        above ``e_key_tol`` when set)."""
        need = tail_bound > (1.0 - tau_cov)
        if self.e_key_tol is not None:
            need = need | (e_key > self.e_key_tol)
        return need if self.expand else torch.zeros_like(need)

    def expanded_k(self, k: torch.Tensor, selector_k_max: int,
                   n_quantized: int | torch.Tensor) -> torch.Tensor:
        """Rung 1: ``K* -> min(max(ceil(factor K*), K* + 1), cap, n_quantized)``."""
        cap = self.key_cap(selector_k_max, n_quantized)
        f = self.expand_factor
        scaled = k * int(f) if f == int(f) else torch.ceil(k * f).long()  # ceil of an integer
        return torch.maximum(torch.maximum(scaled, k + 1).clamp(max=cap), k)

    def layer_dense(self, head_dense: torch.Tensor, canary_ok: torch.Tensor) -> torch.Tensor:
        """Rung 4 (a 0-d bool tensor, no host sync): any canary violation, or at least
        ``layer_dense_fraction`` of heads (and at least one) dense."""
        least = max(1.0, self.layer_dense_fraction * head_dense.numel())
        return ~canary_ok.all() | (head_dense.sum() >= least)
