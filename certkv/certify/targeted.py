"""Targeted page-in (issue 56): mend a failed boundary check (eq. 18) by reading the blocks that
break it (FP16 keys, and values where theirs are lossy) instead of sending the head to rung 3;
and bring a head over its bound tolerance within it by reading the fewest blocks that carry its
bound (:func:`tolerance_plan`) before the ladder's widest sets.

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
from certkv.certify.values import fewest_covering


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


def key_shares(rho: torch.Tensor, delta: torch.Tensor, radius: torch.Tensor,
               lossy: torch.Tensor) -> torch.Tensor:
    """Each block's share of E_key ``[Hq, n]`` (FP64) where its keys are ``lossy [Hq, n]`` (0
    elsewhere): ``2 R`` (``R [Hq]`` the value radius; E_key = 2 R TV) times its term of the
    per-block TV bound's first lane, ``(e^{D_b} - 1) rho_b / W`` with ``W >= max(1 - sum_b rho_b
    (1 - e^{-D_b}), e^{-max_b D_b})`` over the lossy blocks
    (:func:`~certkv.certify.bounds.block_tv_bound`), for block masses ``rho`` and logit error
    bounds ``delta`` ``[Hq, n]``."""
    rho = rho.double()
    d = delta.double().clamp(max=80.0)  # e^80: every such block ranks first anyway
    shrink = torch.where(lossy, rho * -torch.expm1(-d), 0.0).sum(dim=-1)
    w = torch.maximum(1.0 - shrink, torch.exp(-torch.where(lossy, d, 0.0).amax(dim=-1)))
    share = torch.where(lossy & (rho > 0), torch.expm1(d) * rho, 0.0)
    return share * (2.0 * radius.double() / w).unsqueeze(-1)


def tolerance_plan(blocks, read: tuple, over: torch.Tensor, limit: torch.Tensor
                   ) -> tuple[torch.Tensor, int]:
    """The blocks that heads over their bound tolerance read next, whole (FP16 keys and
    values; ``ladder.tol_page_in``), ``[Hq, n]``, and how many new (kv head, block) pairs that
    is (pairs whose keys the pass did not read).

    Per head in ``over [Hq]``: the fewest blocks it still reads lossily whose shares of its
    bound, left out, bring the rest to at most ``limit [Hq]`` (FP64), the largest first
    (:func:`~certkv.certify.values.fewest_covering`). A block's share, from the pass's
    :class:`~certkv.certify.certificate.BlockStats` (Phase-2 masses ``rho_b``, tightened
    ``Delta_b``, ``eta_b``, the head's value radius ``R``) and ``read`` (the FP16 keys ``[Hq,
    n]`` and values ``[Hkv, n]`` it read): where its keys were lossy, :func:`key_shares`; where
    its values were, ``rho_b eta_b`` (Cor. 4.2). The shares only rank and count blocks: the
    pass that reads them certifies afresh."""
    keys_read, values_read = read
    hq, n = keys_read.shape
    group = hq // values_read.shape[0]
    rho = blocks.mass.double()
    key_share = key_shares(rho, blocks.delta, blocks.radius, blocks.quantized & ~keys_read)
    eta = blocks.eta.double().repeat_interleave(group, dim=0)
    lossy_values = (eta > 0) & ~values_read.repeat_interleave(group, dim=0)
    value_share = torch.where(lossy_values, rho * eta, 0.0)
    plan = fewest_covering(key_share + value_share, limit.clamp(min=0.0))
    plan &= over.unsqueeze(-1)
    paged = (keys_read & blocks.quantized).view(-1, group, n).any(dim=1)
    new = plan.view(-1, group, n).any(dim=1) & ~paged
    return plan, int(new.sum())
