"""Runtime checks (paper Section 6): ranking consistency, boundary, score canary, exploration.

Log-masses are unnormalised block log-sum-exps ``l_b = logsumexp_t s_{b,t}`` so Phase-1 (INT8)
and Phase-2 (FP16) values are directly comparable. Shapes: ``[Hq, n]`` per block, ``[Hq]`` out.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")
CANARY_REL = 1e-5  # the canary's allowance for the two logits' FP32 rounding, relative to |s|


def top_r(log_mass: torch.Tensor, members: torch.Tensor, r: int):
    """The ``r`` largest log-masses ``[..., r]`` among ``members`` (broadcast against
    ``log_mass [..., n]``), their indices and how many members exist ``[Hq]``. Equal log-masses
    rank by block index (the order the fused kernel uses too): a stable sort, or for ``r = 1``
    the first maximum."""
    masked = log_mass.masked_fill(~members, NEG_INF)
    k = min(r, log_mass.shape[-1])
    if k == 1:
        values, indices = masked.max(dim=-1, keepdim=True)
    else:
        values, indices = torch.sort(masked, dim=-1, descending=True, stable=True)
        values, indices = values[..., :k], indices[..., :k]
    return values, indices, members.sum(dim=-1)


def _ranking(idx8: torch.Tensor, idx16: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """Eq. 17 from both top-r index lists ``[Hq, k]``: equal wherever a member exists."""
    depth = torch.arange(idx8.shape[-1], device=idx8.device)
    return ((idx8 == idx16) | (depth >= count.unsqueeze(-1))).all(dim=-1)


def boundary_terms(top16: torch.Tensor, count: torch.Tensor, l_int8: torch.Tensor,
                   delta_b: torch.Tensor, tail: torch.Tensor, r: int):
    """What eq. 18 compares, from the FP16 top-r log-masses ``top16 [Hq, k]``: each INT8 tail
    block's upper-bounded log-mass ``l_int8 + delta_b`` (``-inf`` off the ``tail``) ``[Hq, n]``
    and the ``r``-th promoted FP16 log-mass (``-inf`` if fewer are promoted) ``[Hq, 1]``."""
    threshold = torch.where(count >= r, top16[..., -1], NEG_INF)
    upper = (l_int8 + delta_b).masked_fill(~tail, NEG_INF)
    return upper, threshold.unsqueeze(-1)


def _boundary(top16: torch.Tensor, count: torch.Tensor, l_int8: torch.Tensor,
              delta_b: torch.Tensor, tail: torch.Tensor, r: int) -> torch.Tensor:
    """Eq. 18: every INT8 tail block's upper-bounded log-mass stays at or below the ``r``-th
    promoted FP16 log-mass (:func:`boundary_terms`)."""
    upper, threshold = boundary_terms(top16, count, l_int8, delta_b, tail, r)
    return (upper <= threshold).all(dim=-1)


def ranking_consistent(
    l_int8: torch.Tensor, l_fp16: torch.Tensor, promoted: torch.Tensor, r: int
) -> torch.Tensor:
    """Eq. 17: the top-``r`` promoted blocks agree, in order, under INT8 and FP16 log-masses."""
    _, idx, count = top_r(torch.stack([l_int8, l_fp16]), promoted, r)
    return _ranking(idx[0], idx[1], count)


def boundary_ok(
    l_int8: torch.Tensor,
    l_fp16: torch.Tensor,
    delta_b: torch.Tensor,
    promoted: torch.Tensor,
    tail: torch.Tensor,
    r: int,
) -> torch.Tensor:
    """Eq. 18: no INT8 tail block's upper-bounded FP16 log-mass ``l_b + Delta_b`` can enter the
    top-``r`` of the promoted blocks. Holds trivially without tail blocks; fails if a tail exists
    but fewer than ``r`` blocks are promoted (the ranking certificate cannot be issued).
    """
    values, _, count = top_r(l_fp16, promoted, r)
    return _boundary(values, count, l_int8, delta_b, tail, r)


def rank_checks(l_int8, l_fp16, delta_b, promoted, quantized, r: int):
    """Eq. 17 and eq. 18 (:func:`ranking_consistent`, :func:`boundary_ok`) ``[Hq]`` each, from
    one top-``r`` pass over both log-masses (``[Hq, n]``, as ``delta_b`` and ``promoted``);
    eq. 18's INT8 tail is the ``quantized [n]`` blocks not promoted."""
    values, idx, count = top_r(torch.stack([l_int8, l_fp16]), promoted, r)
    return (_ranking(idx[0], idx[1], count),
            _boundary(values[1], count, l_int8, delta_b, quantized & ~promoted, r))


def paged_summaries(l_int8: torch.Tensor, l_fp16: torch.Tensor, promoted: torch.Tensor,
                    summaries: torch.Tensor) -> torch.Tensor:
    """Eq. 17's Phase-1 log-masses ``[Hq, n]`` with every promoted block held at its Tier-1
    summary (``summaries [n]``: evicted) at its FP16 log-mass instead (``ladder.rank_summaries
    = False``): such a block was read whole from Tier-2, and its summary bounds its logits by
    an interval (eq. 18 checks that while it stays unread), it does not rank them. The other
    blocks keep their scores from codes, so the check still compares the codes' order with the
    originals'; eq. 18 reads only unpromoted blocks, which keep theirs."""
    return torch.where(summaries & promoted, l_fp16, l_int8)


def canary_violations(
    s_int8: torch.Tensor, s_fp16: torch.Tensor, delta_b: torch.Tensor, eps_guard: float
) -> torch.Tensor:
    """Score-consistency canary (Section 6) per block: some token has
    ``|s_fp16 - s_int8| > Delta_b + eps_guard``.

    ``s_*: [..., B]`` token logits of one block each (``-inf`` on empty slots), ``delta_b: [...]``.
    A violation means the stored metadata no longer matches the data (P2). The guard also
    absorbs FP32 rounding of the two dot products (relative to ``|s|``). Returns bool ``[...]``.
    """
    size = s_fp16.abs()
    slack = delta_b.unsqueeze(-1) + eps_guard + CANARY_REL * size  # inf where s_fp16 is
    gap = (s_fp16 - s_int8).abs()
    return ((gap > slack) & (s_int8.abs() < float("inf"))).any(dim=-1)


def exploration_mask(tail: torch.Tensor, draw: torch.Tensor, fraction: float) -> torch.Tensor:
    """Pick about ``fraction`` of the tail blocks ``[Hq, n]`` for FP16 spot checks, from a
    uniform ``draw`` of the same shape (:meth:`Ladder.exploration_draw`)."""
    return tail & (draw < fraction)
