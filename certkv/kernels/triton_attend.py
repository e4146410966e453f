"""Triton Phase 2 (paper Alg. 1): one fused split-KV pass with mask-gated FP16 keys.

One launch; grid ``(kv head, program)``, the programs in one group per precision holding blocks
(``triton_sources.program_groups``, as Phase 1's): each program walks ``SPLIT`` of its
precision's blocks for all ``G`` query heads of its kv head. Per block it

* reads the Phase-1 logits; where ``key_slot[kv, block] >= 0`` it also reads the block's
  FP16 keys (staged from the scratch cache / Tier-2; a slot ``<= -2`` reads Tier-2's row
  ``-2 - slot`` in place, host memory through unified addressing on CUDA), computes their
  logits and uses them for
  the query heads whose ``gate`` is set (the promoted set K*), checking on the way the score
  canary ``|s_fp16 - s_int8| <= Delta_b + eps`` (Section 6) for those heads;
* reads the value codes (2/3/4/8-bit), unpacked in registers with their FP16 group scale/offset,
  or, where ``value_slot[kv, block] >= 0`` (or ``<= -2``: Tier-2 in place), staged FP16 values
  (value promotion), or, on an exact
  block (a window, the tail block), the store's FP16 values in place;
* keeps an FP32 online softmax and writes the block max ``m_b``, sum ``l_b`` (block masses) and
  sum of squares ``l2_b = sum_t w_t^2`` (block spreads ``||p_b||_2``), one more accumulator.

Every launch writes its own split states (each split holds at least one block, so there are at
most ``n`` of them, which the rounding chain counts on); the splits are merged by log-sum-exp
in :func:`reduce_splits`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from certkv.certify.arith import dot_chunk
from certkv.kernels.reference import Attended, CheckInputs, Scored
from certkv.kernels.triton_certify import CertifyRequest, certify_args, certify_head
from certkv.kernels.triton_checks import check_head
from certkv.kernels.triton_score import (
    blocks_per_program,
    channel_dot,
    entry,
    inner_group_values,
    load_codes,
    load_group_queries,
    log_or_minus_inf,
    rotated_back,
)
from certkv.kernels.triton_sources import kernel_groups, program_groups, tail_data
from certkv.kernels.triton_tune import autotuned


@triton.jit
def with_outliers(v, idx_ptr, val_ptr, base, m, on, B: tl.constexpr, D: tl.constexpr):
    """A dense decode ``v [B, D]`` with the block's ``m`` exact outliers in place (flat index
    ``t D + c`` and FP16 value at ``base + i``, :mod:`certkv.quant.outlier_value`), read only
    where ``on``."""
    flat = tl.arange(0, B)[:, None] * D + tl.arange(0, D)[None, :]
    for i in range(m):
        at = tl.load(idx_ptr + base + i, mask=on, other=-1).to(tl.int32)
        x = tl.load(val_ptr + base + i, mask=on, other=0.0).to(tl.float32)
        v = tl.where(flat == at, x, v)
    return v


@autotuned
@triton.jit
def _attend_kernel(query, scores, fp16, tail, blocks_out, state, counts_ptr, scaling,
                   eps_guard, groups, G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr,
                   D: tl.constexpr, DOT_C: tl.constexpr, SPLIT: tl.constexpr,
                   LAYOUTS: tl.constexpr):
    """Grid ``(kv head, program)``: the programs of every precision's blocks in one launch,
    program ``p`` writing split state ``p``. The arguments come in bundles (pointers and their
    strides, :func:`_launch_attend`); ``groups[k]``: precision ``k``'s programs ``[first,
    end)`` and what they read; ``LAYOUTS[k]``: its ``(FP16, BITS, BIAS, GROUP, TAIL, CARRIES,
    TOKEN, INNER, NORM, ROT, CODEBOOK, OUTLIERS, ROPE)``
    (:func:`~certkv.kernels.triton_sources.kernel_groups`)."""
    kv = tl.program_id(0)
    p = tl.program_id(1)
    q_ptr, s_qk, s_qg = query
    q = load_group_queries(q_ptr, kv, s_qk, s_qg, G, BLOCK_G, D)
    for k in tl.static_range(len(LAYOUTS)):
        src = groups[k]
        if (p >= src[0]) & (p < src[1]):
            _attend_split(q, kv, p, src, scores, fp16, tail, blocks_out, state, counts_ptr,
                          scaling, eps_guard, G, BLOCK_G, B, D, DOT_C, SPLIT, LAYOUTS[k][0],
                          LAYOUTS[k][1], LAYOUTS[k][2], LAYOUTS[k][3], LAYOUTS[k][4],
                          LAYOUTS[k][5], LAYOUTS[k][6], LAYOUTS[k][7], LAYOUTS[k][9],
                          LAYOUTS[k][10], LAYOUTS[k][11])


@triton.jit
def _attend_split(q, kv, p, src, scores, fp16, tail, blocks_out, state, counts_ptr, scaling,
                  eps_guard, G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr,
                  D: tl.constexpr, DOT_C: tl.constexpr, SPLIT: tl.constexpr,
                  FP16: tl.constexpr, BITS: tl.constexpr, BIAS: tl.constexpr,
                  GROUP: tl.constexpr, TAIL: tl.constexpr, CARRIES: tl.constexpr,
                  TOKEN: tl.constexpr, INNER: tl.constexpr, ROT: tl.constexpr,
                  CODEBOOK: tl.constexpr, OUTLIERS: tl.constexpr):
    """Program ``p``'s ``SPLIT`` blocks of one precision (``src``), merged into split state
    ``p`` (see the module); value codes with a scale and an offset per group, or (``TOKEN``)
    symmetric with a scale per token, ``(code - BIAS) s_t``, or (``CODEBOOK``) normal-float
    levels times a scale per group, or (``INNER``) InnerQ's groups of the block's tokens per
    channel, or (``ROT``) rotated coordinates with a scale and an offset per token and
    subspace, rotated back in registers; with ``OUTLIERS``, the block's exact entries in
    place (:func:`with_outliers`)."""
    (first, _, code_ptr, vs_ptr, vo_ptr, blk_ptr, slot_ptr, s_ck, s_cn, s_ct, s_vk, s_vn, s_vt,
     n_live, walked, _, _, mode_ptr, s_fk, s_fn, _, _, _, basis_ptr, idx_ptr, val_ptr,
     levels_ptr, s_xk, s_xn, n_out, _, _, _) = src
    s_ptr, gate_ptr, delta_ptr, s_sk, s_sg, s_sn = scores
    kslot_ptr, kstaged_ptr, vslot_ptr, vstaged_ptr, k2_ptr, v2_ptr, s_lk, s_kp, s_kt, s_pp, \
        s_pt, s_2p, s_2t = fp16
    tv_ptr, s_tk, s_tt = tail
    mb_ptr, lb_ptr, sb_ptr, canary_ptr, s_bk, s_bg = blocks_out
    m_ptr, l_ptr, acc_ptr, s_mk, s_mg, s_ak, s_ag, s_as = state
    split = p - first
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    gmask = g < G
    m = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    lsum = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, D), tl.float32)
    zero_bd = t[:, None] * 0 + c[None, :] * 0  # [B, D] int zeros: broadcast scalars to masks
    for i in range(SPLIT):
        e = split * SPLIT + i
        blk, slot, beyond, filled = entry(blk_ptr, slot_ptr, counts_ptr, e, n_live, walked,
                                          B, TAIL, CARRIES)
        rows = (t[:, None] + zero_bd) < filled  # [B, D]: filled token slots
        live = e < n_live
        live_g = gmask & ((g * 0 + e) < n_live)
        row = kv * s_bk + g * s_bg + blk  # offset of (kv, g, blk) in the [Hkv, G, n] tensors
        s = tl.load(s_ptr + kv * s_sk + g[:, None] * s_sg + blk * s_sn + t[None, :],
                    mask=live_g[:, None] & (t[None, :] < B), other=float("-inf"))
        kslot = tl.load(kslot_ptr + kv * s_lk + blk)
        violated = tl.zeros((BLOCK_G,), tl.int8)  # the canary of every block, written below
        if live & (kslot != -1):  # FP16 keys for this block: gated logits + canary
            if kslot >= 0:  # staged in the pool
                k16 = tl.load(kstaged_ptr + kslot.to(tl.int64) * s_kp + t[:, None] * s_kt
                              + c[None, :])
            else:  # Tier-2 in place
                k16 = tl.load(k2_ptr + (-2 - kslot).to(tl.int64) * s_2p + t[:, None] * s_2t
                              + c[None, :])
            s16 = channel_dot(q, k16.to(tl.float32), BLOCK_G, B, D, DOT_C) * scaling
            on = tl.load(gate_ptr + row, mask=live_g, other=0) != 0
            delta = tl.load(delta_ptr + row, mask=live_g, other=0.0)
            finite = (tl.abs(s16) < float("inf")) & (tl.abs(s) < float("inf"))
            gap = tl.where(finite, tl.abs(s16 - s), 0.0)
            slack = eps_guard + 1e-5 * tl.where(finite, tl.abs(s16), 0.0)
            bad = on[:, None] & (gap > delta[:, None] + slack)
            violated = tl.max(bad.to(tl.int8), axis=1).to(tl.int8)  # the compiler widens
            s = tl.where(on[:, None], s16, s)
        tl.store(canary_ptr + row, violated, mask=live_g)
        vslot = tl.load(vslot_ptr + kv * s_lk + blk)
        staged = (zero_bd + vslot) >= 0  # FP16 values staged (value promotion)
        direct = (zero_bd + vslot) <= -2  # FP16 values read from Tier-2 in place
        read = rows & ~staged & ~direct & ((zero_bd + e) < n_live)  # codes or originals
        base = kv * s_ck + slot * s_cn
        if FP16:  # an exact block (or FP16 values): the originals in place
            v = tl.load(code_ptr + base + t[:, None] * s_ct + c[None, :], mask=read,
                        other=0.0).to(tl.float32)
        elif INNER:  # InnerQ: per channel over the block's tokens (a scale, slot, mode bit)
            code = load_codes(code_ptr, base, t, c, s_ct, read, BITS)
            at = kv * s_vk + slot * s_vn + c[None, :] + zero_bd
            vs = tl.load(vs_ptr + at, mask=read, other=0.0).to(tl.float32)
            word = tl.load(vo_ptr + at, mask=read, other=0)
            flags = tl.load(mode_ptr + kv * s_fk + slot * s_fn + c[None, :] // 8 + zero_bd,
                            mask=read, other=0).to(tl.int32)
            sym = ((flags >> (c % 8)[None, :]) & 1) != 0
            v = inner_group_values(code, vs, word, sym, ((word >> t[:, None]) & 1) != 0)
        elif ROT > 0:  # rotated coordinates per token and subspace, rotated back
            code = load_codes(code_ptr, base, t, c, s_ct, read, BITS)
            grp = kv * s_vk + slot * s_vn + t[:, None] * s_vt + c[None, :] // (D // ROT)
            v = rotated_back(code, vs_ptr, vo_ptr, grp, read, basis_ptr, D)
        else:  # codes unpacked in registers with their FP16 group scale/offset
            code = load_codes(code_ptr, base, t, c, s_ct, read, BITS)
            grp = kv * s_vk + slot * s_vn + t[:, None] * s_vt + c[None, :] // GROUP
            vs = tl.load(vs_ptr + grp, mask=read, other=0.0).to(tl.float32)
            if TOKEN:  # exact: an integer of at most 8 bits times an FP16 scale
                v = (code - BIAS) * vs
            elif CODEBOOK:  # normal-float levels: L[code] S, one rounding (the codec's)
                v = tl.load(levels_ptr + code.to(tl.int32), mask=read, other=0.0) * vs
            else:
                vo = tl.load(vo_ptr + grp, mask=read, other=0.0).to(tl.float32)
                v = code * vs + vo
            if OUTLIERS:  # dense-and-sparse: the block's exact entries in place
                v = with_outliers(v, idx_ptr, val_ptr, kv * s_xk + slot * s_xn, n_out,
                                  live, B, D)
        if beyond:  # the tail block (FP16 values from the store's tail buffer) or an empty one
            v = tl.load(tv_ptr + kv * s_tk + t[:, None] * s_tt + c[None, :], mask=read,
                        other=0.0).to(tl.float32)
        v16 = tl.load(vstaged_ptr + tl.maximum(vslot, 0).to(tl.int64) * s_pp + t[:, None] * s_pt
                      + c[None, :], mask=staged, other=0.0).to(tl.float32)
        v2 = tl.load(v2_ptr + tl.maximum(-2 - vslot, 0).to(tl.int64) * s_2p + t[:, None] * s_2t
                     + c[None, :], mask=direct, other=0.0).to(tl.float32)
        v = tl.where(staged, v16, tl.where(direct, v2, v))  # [B, D]
        m_b = tl.max(s, axis=1)  # [BLOCK_G]
        m_safe = tl.where(m_b == float("-inf"), 0.0, m_b)
        w = tl.exp(s - m_safe[:, None])
        l_b = tl.sum(w, axis=1)
        l2_b = tl.sum(w * w, axis=1)
        o_b = tl.sum(w[:, :, None] * v[None, :, :], axis=1)  # [BLOCK_G, D]
        tl.store(mb_ptr + row, m_b, mask=live_g)
        tl.store(lb_ptr + row, l_b, mask=live_g)
        tl.store(sb_ptr + row, l2_b, mask=live_g)
        m_new = tl.maximum(m, m_b)
        m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_new_safe)
        beta = tl.exp(m_b - m_new_safe)
        lsum = lsum * alpha + l_b * beta
        acc = acc * alpha[:, None] + o_b * beta[:, None]
        m = m_new
    tl.store(m_ptr + kv * s_mk + g * s_mg + p, m, mask=gmask)
    tl.store(l_ptr + kv * s_mk + g * s_mg + p, lsum, mask=gmask)
    tl.store(acc_ptr + kv * s_ak + g[:, None] * s_ag + p * s_as + c[None, :], acc,
             mask=gmask[:, None])


@triton.jit
def _reduce_kernel(mb_ptr, lb_ptr, sb_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, rho_ptr, lm_ptr,
                   sp_ptr, l8_ptr, dt_ptr, prom_ptr, quant_ptr, rank_ptr, bound_ptr,
                   logp_ptr, dch_ptr, exact_ptr, canb_ptr, vkv_ptr, s_vkv, eta_ptr, vspec_ptr,
                   kspec_ptr, s_kv, delta_ptr, vmax_ptr, vrad_ptr, qnorm_ptr, q_ptr, kam_ptr,
                   etamax_ptr, vmaxkv_ptr, par_ptr, w_ptr, expanded_ptr, res_ptr, resi_ptr,
                   pre_ptr, canary_ptr,
                   n_blocks, n_splits, s_h, s_mh, s_ah, s_as, s_oh,
                   D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_N: tl.constexpr,
                   R: tl.constexpr, CHECKS: tl.constexpr, CERTIFY: tl.constexpr,
                   G: tl.constexpr, CERTIFIED: tl.constexpr, CANARY: tl.constexpr,
                   WANTED: tl.constexpr):
    """One program per query head merges its splits and writes its block masses, log-masses
    and spreads; with ``CHECKS``, then the ranking and boundary checks over those log-masses
    (:func:`~certkv.kernels.triton_checks.check_head`); with ``CERTIFY``, then the head's
    certificate (:func:`~certkv.kernels.triton_certify.certify_head`)."""
    h = tl.program_id(0)
    c = tl.arange(0, D)
    top = float("-inf")
    for start in range(0, n_splits, BLOCK_S):
        sp = start + tl.arange(0, BLOCK_S)
        mv = tl.load(m_ptr + h * s_mh + sp, mask=sp < n_splits, other=float("-inf"))
        top = tl.maximum(top, tl.max(mv, axis=0))
    total = 0.0
    out = tl.zeros((D,), tl.float32)
    for start in range(0, n_splits, BLOCK_S):
        sp = start + tl.arange(0, BLOCK_S)
        live = sp < n_splits
        mv = tl.load(m_ptr + h * s_mh + sp, mask=live, other=float("-inf"))
        weight = tl.where(live, tl.exp(mv - top), 0.0)
        total += tl.sum(weight * tl.load(l_ptr + h * s_mh + sp, mask=live, other=0.0), axis=0)
        acc = tl.load(acc_ptr + h * s_ah + sp[:, None] * s_as + c[None, :],
                      mask=live[:, None], other=0.0)
        out += tl.sum(weight[:, None] * acc, axis=0)
    out = out / total
    tl.store(out_ptr + h * s_oh + c, out)
    for start in range(0, n_blocks, BLOCK_N):
        b = start + tl.arange(0, BLOCK_N)
        live = b < n_blocks
        mb = tl.load(mb_ptr + h * s_h + b, mask=live, other=float("-inf"))
        lb = tl.load(lb_ptr + h * s_h + b, mask=live, other=1.0)
        sb = tl.load(sb_ptr + h * s_h + b, mask=live, other=1.0)
        scale = tl.exp(mb - top)
        tl.store(rho_ptr + h * s_h + b, scale * lb / total, mask=live)
        tl.store(sp_ptr + h * s_h + b, scale * tl.sqrt_rn(sb) / total, mask=live)
        tl.store(lm_ptr + h * s_h + b, mb + log_or_minus_inf(lb), mask=live)
    ranking = True
    boundary = True
    if CHECKS or CERTIFY:  # the epilogues read back what this program just wrote
        tl.debug_barrier()
    if CHECKS:
        ranking, boundary = check_head(l8_ptr, lm_ptr, dt_ptr, prom_ptr, quant_ptr, rank_ptr,
                                       bound_ptr, h, n_blocks, s_h, R, BLOCK_N)
        if (WANTED & 1) == 0:  # a check the ladder leaves off passes
            ranking = True
        if (WANTED & 2) == 0:
            boundary = True
    if CERTIFY:
        certify_head(h, n_blocks, s_h, l8_ptr, lm_ptr, rho_ptr, sp_ptr, logp_ptr, dt_ptr,
                     dch_ptr, prom_ptr, exact_ptr, canb_ptr, vkv_ptr, s_vkv, eta_ptr, vspec_ptr,
                     kspec_ptr, s_kv, delta_ptr, vmax_ptr, vrad_ptr, qnorm_ptr, q_ptr,
                     kam_ptr, etamax_ptr, vmaxkv_ptr, par_ptr, w_ptr, out, ranking, boundary,
                     expanded_ptr, res_ptr, resi_ptr, pre_ptr, canary_ptr, G, D, BLOCK_N,
                     CERTIFIED, CANARY)


def reduce_splits(m_b, l_b, m, lsum, acc, l2_b=None, checks: CheckInputs | None = None,
                  certify: CertifyRequest | None = None) -> Attended:
    """Merge per-split online-softmax states by log-sum-exp (one kernel); block masses
    ``rho_b = e^{m_b - top} l_b / total``, log-masses ``m_b + log l_b`` and spreads
    ``||p_b||_2 = e^{m_b - top} sqrt(l2_b) / total``; given ``checks``, the ranking and
    boundary flags (eq. 17-18) in the same launch; given ``certify``, the certificate too
    (``Attended.certified``, :mod:`~certkv.kernels.triton_certify`; its ``canary_blocks``
    Phase 2's, already written).

    Shapes: ``m_b, l_b, l2_b [Hkv, G, n]`` (``l2_b`` None: spreads of one-token blocks);
    ``m, lsum [Hkv, G, S]``; ``acc [Hkv, G, S, d]``; FP32.
    """
    hkv, g, n = m_b.shape
    n_splits, d = acc.shape[2], acc.shape[3]
    hq = hkv * g
    l2_b = l_b.square() if l2_b is None else l2_b
    m_b, l_b, l2_b = m_b.reshape(hq, n), l_b.reshape(hq, n), l2_b.reshape(hq, n)
    m, lsum, acc = m.reshape(hq, n_splits), lsum.reshape(hq, n_splits), acc.reshape(hq, n_splits,
                                                                                      d)
    out = torch.empty(hq, d, device=m.device)
    rho, log_mass, spread = (torch.empty_like(m_b) for _ in range(3))
    flags = torch.empty(2, hq, dtype=torch.bool, device=m.device)
    inputs, r = _check_args(checks, certify, m_b, flags)
    cert, certified = certify_args(certify, m_b, out)
    _reduce_kernel[(hq,)](m_b, l_b, l2_b, m, lsum, acc, out, rho, log_mass, spread,
                          *inputs, flags[0], flags[1], *cert, n, n_splits,
                          m_b.stride(0), m.stride(0), acc.stride(0), acc.stride(1),
                          out.stride(0), D=d,
                          BLOCK_S=min(64, triton.next_power_of_2(n_splits)),
                          BLOCK_N=min(1024, triton.next_power_of_2(n)), R=r,
                          CHECKS=checks is not None, CERTIFY=certify is not None, G=g,
                          CERTIFIED=bool(certify and certify.certified),
                          CANARY=bool(certify and certify.canary),
                          WANTED=certify.wanted if certify else 3)
    return Attended(out=out.reshape(hkv, g, d), rho=rho.reshape(hkv, g, n),
                    log_mass=log_mass.reshape(hkv, g, n), spread=spread.reshape(hkv, g, n),
                    ranking=None if checks is None else flags[0],
                    boundary=None if checks is None else flags[1],
                    certified=certified or None)


def _check_args(checks: CheckInputs | None, certify: CertifyRequest | None, m_b, flags):
    """The merge's ``l8, delta_b, promoted [Hq, n], quantized [n]`` and ``r``: the checks', else
    the certificate's (it reads the first three), else valid pointers the kernel never reads."""
    if checks is not None:
        inputs, r = (checks.l_int8.float(), checks.delta_b.float(), checks.promoted,
                     checks.quantized), checks.r
    elif certify is not None:
        x = certify.x
        inputs, r = (x.l8, x.delta_b, x.promoted, flags[0]), 1
    else:
        return (m_b, m_b, flags, flags), 1
    inputs = tuple(x.contiguous() for x in inputs)  # the masks are read as bool
    assert all(x.stride(0) == m_b.stride(0) for x in inputs[:3])
    return inputs, r


class FP16Slots(NamedTuple):
    """Where Phase 2 finds FP16 keys and values: int32 ``[Hkv, n]`` slots into FP16 blocks
    ``[P, B, d]`` (-1: not staged; ``<= -2``: row ``-2 - slot`` of ``tier2``)."""

    key_slot: torch.Tensor
    key_data: torch.Tensor
    value_slot: torch.Tensor
    value_data: torch.Tensor
    tier2: tuple[torch.Tensor, torch.Tensor] | None = None  # FP16 originals (k, v) [R, B, d]


def attend_blocks(scored: Scored, q: torch.Tensor, gate: torch.Tensor, sources: list,
                  fp16: FP16Slots, scaling: float, eps_guard: float, *,
                  split: int | None = None, checks: CheckInputs | None = None,
                  certify: CertifyRequest | None = None) -> Attended:
    """Phase 2 over ``n`` blocks given as :class:`~certkv.kernels.triton_sources.BlockSource`
    groups of value codes (one per precision, the last carrying the exact tail block: see
    :func:`~certkv.kernels.triton_sources.program_groups`) in one launch, merged in one
    reduction.

    Args:
        scored: Phase-1 logits ``[Hkv, G, n, B]`` and ``delta_b [Hkv, G, n]``.
        q: ``[Hkv, G, d]``; gate: bool ``[Hkv, G, n]`` (use FP16-key logits where staged).
        fp16: the FP16 key and value slots (:class:`FP16Slots`); its ``tier2``: the FP16
            originals ``(k, v)`` as ``[R, B, d]`` row views (strides only: Tier-2 is read in
            place, pinned host memory on CUDA), or None where no slot is ``<= -2``.
        checks: the ranking and boundary checks' inputs, run in the merge's epilogue, or None.
        certify: the certificate's inputs, computed in the merge's epilogue after the checks
            (:mod:`~certkv.kernels.triton_certify`), or None.
    Returns:
        :class:`Attended` with the canary violations of the gated blocks (and the checks, and
        the certificate).
    """
    scores = scored.scores.contiguous()
    hkv, g, n, _ = scores.shape
    d = q.shape[-1]
    split = split or blocks_per_program(n, hkv, scores.device)
    plan = program_groups(sources, n)
    grouped = kernel_groups(plan, split)  # (groups, layouts, programs)
    programs = grouped[2]
    dev = scores.device
    m_b = torch.empty(hkv, g, n, device=dev)
    l_b, l2_b = torch.empty_like(m_b), torch.empty_like(m_b)
    canary = torch.empty(hkv, g, n, dtype=torch.bool, device=dev)  # every block written
    m = torch.empty(hkv, g, programs, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(hkv, g, programs, d, device=dev)
    # masks are read as bool, in the [Hkv, G, n] layout of m_b and canary
    gate, delta = gate.contiguous(), scored.delta_b.float().contiguous()
    key_data, value_data = fp16.key_data.contiguous(), fp16.value_data.contiguous()
    tier2 = fp16.tier2 or (key_data, key_data)  # never read without a slot <= -2
    shared = (scores, q.float().contiguous(), fp16.key_slot.contiguous(), key_data,
              gate, delta, fp16.value_slot.contiguous(), value_data, tier2,
              (m_b, l_b, l2_b, canary), (m, lsum, acc))
    _launch_attend(plan, grouped, shared, scaling, eps_guard, split)
    if certify is not None:  # the certificate reads this step's canary
        certify = certify._replace(x=certify.x._replace(canary_blocks=canary))
    att = reduce_splits(m_b, l_b, m, lsum, acc, l2_b, checks, certify)
    att.canary = canary
    return att


def _launch_attend(plan, grouped, shared, scaling, eps_guard, split) -> None:
    """Phase 2's one launch over the ``plan`` of
    :func:`~certkv.kernels.triton_sources.program_groups` with its ``grouped`` arguments
    (:func:`~certkv.kernels.triton_sources.kernel_groups`: a group of programs per precision,
    the last carrying the tail block): block statistics at their indices, one split state per
    program. The kernel's arguments go in bundles of pointers and their strides."""
    (scores, q, key_slot, key_data, gate, delta, value_slot, value_data, (k2, v2), blocks_out,
     state) = shared
    m_b, l_b, l2_b, canary = blocks_out
    m, lsum, acc = state
    hkv, g, _, bsz = scores.shape
    d = q.shape[-1]
    groups, layouts, programs = grouped
    tail_v = tail_data(plan)
    _attend_kernel[(hkv, programs)](
        (q, q.stride(0), q.stride(1)),
        (scores, gate, delta, scores.stride(0), scores.stride(1), scores.stride(2)),
        (key_slot, key_data, value_slot, value_data, k2, v2, value_slot.stride(0),
         key_data.stride(0), key_data.stride(1), value_data.stride(0), value_data.stride(1),
         k2.stride(0), k2.stride(1)),
        (tail_v, tail_v.stride(0), tail_v.stride(2)),
        (m_b, l_b, l2_b, canary, m_b.stride(0), m_b.stride(1)),
        (m, lsum, acc, m.stride(0), m.stride(1), acc.stride(0), acc.stride(1), acc.stride(2)),
        plan[0][0].counts, float(scaling), float(eps_guard), groups,
        G=g, BLOCK_G=triton.next_power_of_2(g), B=bsz, D=d, DOT_C=dot_chunk(d), SPLIT=split,
        LAYOUTS=layouts)

