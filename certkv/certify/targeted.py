"""Targeted page-in (issue 56): mend a failed boundary check (eq. 18) by reading the blocks that
break it (FP16 keys, and values where theirs are lossy) instead of sending the head to rung 3.

Eq. 18 fails for a head when some block it reads from quantized keys (or from an evicted
block's summary) has an upper-bounded log-mass ``l_b + Delta_b`` above the ``r``-th FP16
log-mass of its promoted blocks. Promoting exactly those blocks and checking again keeps eq.
18's guarantee intact: the check is the same, only the set of blocks read with FP16 keys grows.
Promoting a block never lowers the ``r``-th promoted FP16 log-mass, so once every breaking block
is promoted the re-check holds (unless eq. 17, the ranking check, now fails: such a head still
goes to rung 3). A per-step budget caps the (kv head, block) pairs read for it; the largest
upper bounds go first. Shapes: ``[Hq, n]`` per block and query head, ``[Hkv, n]`` per kv head.
"""

from __future__ import annotations

import torch

from certkv.certify.checks import NEG_INF, boundary_terms, top_r


def boundary_breakers(l_int8: torch.Tensor, l_fp16: torch.Tensor, delta_b: torch.Tensor,
                      promoted: torch.Tensor, tail: torch.Tensor, r: int):
    """The blocks that make eq. 18 fail ``[Hq, n]`` (bool: tail blocks whose ``l_int8 +
    delta_b`` is not at or below the ``r``-th promoted ``l_fp16``, as
    :func:`~certkv.certify.checks.boundary_ok` compares them) and their upper bounds ``[Hq, n]``
    (``-inf`` off the tail). ``tail [n]`` or ``[Hq, n]``: blocks read without FP16 keys."""
    values, _, count = top_r(l_fp16, promoted, r)
    tail = tail & ~promoted
    upper, threshold = boundary_terms(values, count, l_int8, delta_b, tail, r)
    return tail & ~(upper <= threshold), upper


def plan(breakers: torch.Tensor, upper: torch.Tensor, paged: torch.Tensor,
         budget: int | None) -> tuple[torch.Tensor, int]:
    """The blocks to promote ``[Hq, n]`` and how many new (kv head, block) pairs they read
    (pairs whose keys the pass did not read; read whole, values too where lossy):
    every breaker whose kv head's keys are read already (``paged [Hkv, n]``) or among the
    ``budget`` new pairs with the largest upper bounds (``None``: no cap)."""
    hkv, n = paged.shape
    group = breakers.shape[0] // hkv
    per_kv = breakers.view(hkv, group, n)
    new = per_kv.any(dim=1) & ~paged
    count = int(new.sum())
    if budget is not None and count > budget:
        score = upper.view(hkv, group, n).masked_fill(~per_kv, NEG_INF).amax(dim=1)
        score = score.masked_fill(~new, NEG_INF).flatten()
        order = torch.sort(score, descending=True, stable=True).indices[:budget]
        new = torch.zeros_like(new).flatten().index_fill(0, order, True).view(hkv, n)
        count = budget
    readable = (new | paged).repeat_interleave(group, dim=0)
    return breakers & readable, count
