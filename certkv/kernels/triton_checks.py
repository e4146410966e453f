"""Triton ranking and boundary checks (paper eq. 17-18): the epilogue of Phase 2's merge
(:func:`check_head`, per query head), or one tiny kernel after Phase 2.

One program per query head walks its ``n`` block log-masses in chunks of ``BLOCK_N``. The
``j``-th ranked promoted block (value descending, index ascending on ties, as the reference's
stable sort) is found as the best block strictly after the ``(j-1)``-th in that order, so ``r``
rounds need no sorting and no state beyond the previous pick. No host round-trip: the flags
stay on the device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _next_ranked(l_ptr, prom_ptr, row, n, prev_v, prev_i, BLOCK_N: tl.constexpr):
    """Value and index of the best promoted block ranked after ``(prev_v, prev_i)``."""
    best_v = float("-inf")
    best_i = n  # sentinel: none
    for start in range(0, n, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        live = idx < n
        member = tl.load(prom_ptr + row + idx, mask=live, other=0) != 0
        v = tl.load(l_ptr + row + idx, mask=live, other=float("-inf"))
        after = (v < prev_v) | ((v == prev_v) & (idx > prev_i))
        cand = member & after
        v = tl.where(cand, v, float("-inf"))
        top = tl.max(v, axis=0)
        top_i = tl.min(tl.where(cand & (v == top), idx, n), axis=0)
        better = (top_i < n) & ((top > best_v) | ((top == best_v) & (top_i < best_i))
                                | (best_i == n))
        best_v = tl.where(better, top, best_v)
        best_i = tl.where(better, top_i, best_i)
    return best_v, best_i


@triton.jit
def _checks_kernel(l8_ptr, l16_ptr, delta_ptr, prom_ptr, quant_ptr, rank_ptr, bound_ptr,
                   n, s_h, R: tl.constexpr, BLOCK_N: tl.constexpr):
    check_head(l8_ptr, l16_ptr, delta_ptr, prom_ptr, quant_ptr, rank_ptr, bound_ptr,
               tl.program_id(0), n, s_h, R, BLOCK_N)


@triton.jit
def check_head(l8_ptr, l16_ptr, delta_ptr, prom_ptr, quant_ptr, rank_ptr, bound_ptr, h, n,
               s_h, R: tl.constexpr, BLOCK_N: tl.constexpr):
    """Eq. 17 and 18 of query head ``h`` (row ``h * s_h`` of the ``[Hq, n]`` inputs), stored
    and returned; also the epilogue of Phase 2's merge (:mod:`certkv.kernels.triton_attend`)."""
    row = h * s_h
    upper = float("-inf")  # max over INT8 tail blocks of l8 + Delta_b (eq. 18)
    for start in range(0, n, BLOCK_N):
        idx = start + tl.arange(0, BLOCK_N)
        live = idx < n
        quantized = tl.load(quant_ptr + idx, mask=live, other=0) != 0
        tail = quantized & (tl.load(prom_ptr + row + idx, mask=live, other=0) == 0)
        l8 = tl.load(l8_ptr + row + idx, mask=live, other=0.0)
        d = tl.load(delta_ptr + row + idx, mask=live, other=0.0)
        upper = tl.maximum(upper, tl.max(tl.where(tail, l8 + d, float("-inf")), axis=0))
    ranking = True
    p8_v = float("inf")
    p8_i = -1
    p16_v = float("inf")
    p16_i = -1
    for _ in tl.static_range(R):
        p8_v, p8_i = _next_ranked(l8_ptr, prom_ptr, row, n, p8_v, p8_i, BLOCK_N)
        p16_v, p16_i = _next_ranked(l16_ptr, prom_ptr, row, n, p16_v, p16_i, BLOCK_N)
        ranking = ranking & (p8_i == p16_i)  # both n (no r-th block) also agree
    threshold = tl.where(p16_i < n, p16_v, float("-inf"))  # r-th FP16 log-mass, if any
    boundary = upper <= threshold
    tl.store(rank_ptr + h, ranking.to(tl.int8))
    tl.store(bound_ptr + h, boundary.to(tl.int8))
    return ranking, boundary


def ranking_and_boundary(l_int8: torch.Tensor, l_fp16: torch.Tensor, delta_b: torch.Tensor,
                         promoted: torch.Tensor, quantized: torch.Tensor, r: int,
                         block_n: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 17 and eq. 18 per head from ``[Hq, n]`` log-masses, ``Delta_b`` and the promoted
    mask, and the quantized blocks ``[n]`` (the INT8 tail of eq. 18: quantized, not promoted).

    Same results as :func:`certkv.certify.checks.rank_checks`; returns two bool ``[Hq]``
    (the masks are read as bool: no conversion launches).
    """
    hq, n = l_int8.shape
    dev = l_int8.device
    l8, l16, d, prom = (x.contiguous() for x in (l_int8.float(), l_fp16.float(),
                                                  delta_b.float(), promoted))
    rank = torch.empty(hq, dtype=torch.bool, device=dev)
    bound = torch.empty_like(rank)
    block_n = min(block_n, triton.next_power_of_2(max(n, 1)))
    _checks_kernel[(hq,)](l8, l16, d, prom, quantized.contiguous(), rank, bound, n,
                          l8.stride(0), R=r, BLOCK_N=block_n)
    return rank, bound
