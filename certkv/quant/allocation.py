"""Bit allocation over blocks under a memory budget (seed 001, SmartKV; pure functions).

Units are blocks (SmartKV's tokens, aggregated per block: see :mod:`certkv.quant.smartkv`). A
block at ``b`` bits costs ``cost[b]`` bits per element (codes plus scales), the budget is a mean
cost per element over the unprotected blocks, and protected blocks sit at the top width outside
it. Bit widths move along the ladder ``2 <-> 3 <-> 4 <-> 8``.

* :func:`seed_allocation`: the seed's rule. Rank by importance (stable, ties to the newer block),
  tiers by rank (top 10% 8 bits, to 30% 4, to 70% 3, the rest 2; top 5% 8), then the budget
  pass: over budget, passes from the least important block lower one rung each until the budget
  holds; under it, passes from the most important raise one rung where the budget still holds,
  until a pass changes nothing.
* :func:`greedy_allocation`: the certificate-driven rule. Each block's error is modelled as its
  measured sensitivity times the step of its width (``1 / (2^(b-1) - 1)``); from all-2-bit, the
  upgrades with the largest error reduction per bit are taken while the budget holds.
"""

from __future__ import annotations

from itertools import pairwise

import torch

LADDER = (2, 3, 4, 8)
TIERS = ((0.10, 8), (0.30, 4), (0.70, 3))  # rank fraction -> width; below: 2 bits
TOP_FRACTION = 0.05  # the top 5% at 8 bits


def step_size(bits: int) -> float:
    """The symmetric quantizer's relative step ``1 / (2^(b-1) - 1)`` (its error per unit)."""
    return 1.0 / ((1 << (bits - 1)) - 1)


def rank_order(score: torch.Tensor) -> torch.Tensor:
    """Block indices ``[n]`` from most to least important: by ``score`` descending, ties to the
    newer (higher-index) block."""
    newest_first = torch.arange(score.numel() - 1, -1, -1)
    order = torch.sort(score[newest_first], descending=True, stable=True).indices
    return newest_first[order]


def tier_bits(n: int) -> torch.Tensor:
    """Widths by rank ``[n]`` (rank 1 first): the seed's tiers."""
    rank = torch.arange(1, n + 1)
    bits = torch.full((n,), 2, dtype=torch.long)
    for fraction, width in reversed(TIERS):
        bits[rank <= int(fraction * n)] = width
    bits[rank <= int(TOP_FRACTION * n)] = 8
    return bits


def _step(bits: int, up: bool) -> int:
    i = LADDER.index(bits) + (1 if up else -1)
    return LADDER[min(max(i, 0), len(LADDER) - 1)]


def fit_budget(bits: torch.Tensor, order: torch.Tensor, protected: torch.Tensor,
               cost: dict[int, float], budget: float, upgrade: bool = True) -> torch.Tensor:
    """The seed's budget pass on widths ``bits [n]`` (a copy is returned), ``order`` from most
    to least important, never touching ``protected`` blocks; ``upgrade=False`` only lowers."""
    width, free = bits.tolist(), (~protected).tolist()
    walk = [i for i in order.tolist() if free[i]]
    total = sum(cost[w] for w, f in zip(width, free, strict=True) if f)
    limit = budget * len(walk)
    changed = True
    while total > limit and changed:  # over: lower from the least important
        changed = False
        for i in reversed(walk):
            if total <= limit:
                break
            lower = _step(width[i], up=False)
            if lower != width[i]:
                total += cost[lower] - cost[width[i]]
                width[i], changed = lower, True
    changed = upgrade
    while changed:  # under: raise from the most important while it still fits
        changed = False
        for i in walk:
            higher = _step(width[i], up=True)
            extra = cost[higher] - cost[width[i]]
            if higher != width[i] and total + extra <= limit:
                total += extra
                width[i], changed = higher, True
    return torch.tensor(width, dtype=torch.long)


def seed_allocation(score: torch.Tensor, protected: torch.Tensor, cost: dict[int, float],
                    budget: float) -> torch.Tensor:
    """Widths ``[n]`` (int64) for blocks of importance ``score [n]`` (seed 001's rule)."""
    n = score.numel()
    order = rank_order(score.double().cpu())
    bits = torch.empty(n, dtype=torch.long)
    bits[order] = tier_bits(n)
    bits[protected] = 8
    return fit_budget(bits, order, protected, cost, budget)


def greedy_allocation(sensitivity: torch.Tensor, protected: torch.Tensor,
                      cost: dict[int, float], budget: float) -> torch.Tensor:
    """Widths ``[n]`` minimising ``sum_b sensitivity_b step(bits_b)`` greedily under the budget:
    upgrades sorted by error reduction per bit (per block they come in ladder order, since the
    reduction per bit falls along the ladder), taken while they fit; ties to newer blocks."""
    sens = sensitivity.double().cpu().clamp_min(0).tolist()
    free = [i for i, p in enumerate(protected.tolist()) if not p]
    width = [8 if p else LADDER[0] for p in protected.tolist()]
    total, limit = cost[LADDER[0]] * len(free), budget * len(free)
    moves = [(sens[i] * (step_size(low) - step_size(high)) / (cost[high] - cost[low]), i, high)
             for low, high in pairwise(LADDER) for i in free]
    moves.sort(key=lambda m: (-m[0], -m[1], m[2]))  # ties: newer blocks, then the ladder
    blocked = set()
    for _, i, high in moves:
        extra = cost[high] - cost[width[i]]
        if i in blocked or _step(width[i], up=True) != high or total + extra > limit:
            blocked.add(i)  # a block whose next rung does not fit stays where it is
            continue
        total += extra
        width[i] = high
    return torch.tensor(width, dtype=torch.long)


def mean_cost(bits: torch.Tensor, protected: torch.Tensor, cost: dict[int, float]) -> float:
    """The mean cost per element of the unprotected blocks (0 without any)."""
    free = bits[~protected].tolist()
    return sum(cost[b] for b in free) / len(free) if free else 0.0


def realloc_period(num_tokens: int) -> int:
    """Seed 001's ``f(N) = max(8, min(64, 16 (1 + N / 512)))`` decode steps."""
    return max(8, min(64, int(16 * (1 + num_tokens / 512))))
