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
in :func:`~certkv.kernels.triton_merge.reduce_splits`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from certkv.certify.arith import dot_chunk
from certkv.kernels.records import integer, pointer, records
from certkv.kernels.reference import Attended, CheckInputs, Scored
from certkv.kernels.triton_certify import CertifyRequest
from certkv.kernels.triton_merge import (
    CertifyBatch,
    Merged,
    as_batch,
    batch_checks,
    reduce_batch,
)
from certkv.kernels.triton_score import (
    blocks_per_program,
    channel_dot,
    entry,
    group_fields,
    inner_group_values,
    load_codes,
    load_group_queries,
    rotated_back,
)
from certkv.kernels.triton_sources import batch_groups, program_groups, tail_data
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
def _attend_kernel(query, scores, slots, seq_ptr, blocks_out, state, scaling, eps_guard,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                   DOT_C: tl.constexpr, SPLIT: tl.constexpr, LAYOUTS: tl.constexpr,
                   KINDS: tl.constexpr):
    """Grid ``(kv head, program, sequence)``: the programs of every precision's blocks of
    every sequence of a batch in one launch, program ``p`` of sequence ``s`` writing its split
    state ``p``. The step's tensors come in bundles of a pointer, its strides and its sequence
    stride (:func:`_launch_attend`); sequence ``s``'s record (:mod:`~certkv.kernels.records`)
    holds its tail block's values, block counts, FP16 pools and Tier-2 rows with their strides,
    then per group of ``LAYOUTS`` its programs ``[first, end)`` and what they read
    (:func:`~certkv.kernels.triton_score.group_fields`); ``LAYOUTS[k]``: ``(FP16, BITS, BIAS,
    GROUP, TAIL, CARRIES, TOKEN, INNER, NORM, ROT, CODEBOOK, OUTLIERS, ROPE)``
    (:func:`~certkv.kernels.triton_sources.kernel_groups`)."""
    kv = tl.program_id(0)
    p = tl.program_id(1)
    seq = tl.program_id(2)
    rec = seq_ptr + seq * len(KINDS)
    q_ptr, s_qs, s_qk, s_qg = query
    q = load_group_queries(q_ptr + seq * s_qs, kv, s_qk, s_qg, G, BLOCK_G, D)
    s_ptr, gate_ptr, delta_ptr, s_ss, s_bs, s_sk, s_sg, s_sn = scores
    scored = (s_ptr + seq * s_ss, gate_ptr + seq * s_bs, delta_ptr + seq * s_bs, s_sk, s_sg,
              s_sn)
    kslot_ptr, vslot_ptr, s_ls, s_lk = slots
    fp16 = (kslot_ptr + seq * s_ls, pointer(rec, 4, KINDS[4]), vslot_ptr + seq * s_ls,
            pointer(rec, 5, KINDS[5]), pointer(rec, 6, KINDS[6]), pointer(rec, 7, KINDS[7]),
            s_lk, integer(rec, 8), integer(rec, 9), integer(rec, 10), integer(rec, 11),
            integer(rec, 12), integer(rec, 13))
    tail = (pointer(rec, 0, KINDS[0]), integer(rec, 1), integer(rec, 2))
    mb_ptr, lb_ptr, sb_ptr, canary_ptr, s_bk, s_bg = blocks_out
    blocks = (mb_ptr + seq * s_bs, lb_ptr + seq * s_bs, sb_ptr + seq * s_bs,
              canary_ptr + seq * s_bs, s_bk, s_bg)
    m_ptr, l_ptr, acc_ptr, s_ms, s_mk, s_mg, s_as0, s_ak, s_ag, s_as = state
    split_state = (m_ptr + seq * s_ms, l_ptr + seq * s_ms, acc_ptr + seq * s_as0, s_mk, s_mg,
                   s_ak, s_ag, s_as)
    counts_ptr = pointer(rec, 3, KINDS[3])
    for k in tl.static_range(len(LAYOUTS)):
        src = group_fields(rec, 14 + 33 * k, KINDS)
        if (p >= src[0]) & (p < src[1]):
            _attend_split(q, kv, p, src, scored, fp16, tail, blocks, split_state, counts_ptr,
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
    n = scored.scores.shape[2]
    slots = (fp16.key_slot[None], fp16.value_slot[None])
    pools = [(fp16.key_data, fp16.value_data, fp16.tier2)]
    if certify is not None:
        certify = as_batch(certify, checks.quantized if checks is not None else None)
    batch = Phase2Batch(scored.scores[None], scored.delta_b[None], q[None], gate[None], slots,
                        [(sources, n, pools[0])])
    merged, canary = attend_batch(batch, scaling, eps_guard, split=split,
                                  checks=batch_checks(checks), certify=certify)
    att = merged.sequence(0, [n], q.shape[1])
    att.canary = canary[0]
    return att


class Phase2Batch(NamedTuple):
    """A batch's Phase 2 inputs: the step's tensors with a leading sequence axis (``W`` block
    columns) and what each sequence reads of its own."""

    scores: torch.Tensor  # [S, Hkv, G, W, B] Phase-1 logits
    delta: torch.Tensor  # [S, Hkv, G, W] Phase 1's Delta_b
    q: torch.Tensor  # [S, Hkv, G, d]
    gate: torch.Tensor  # bool [S, Hkv, G, W]: FP16-key logits where staged
    slots: tuple  # the FP16 key and value slot maps, int32 [S, Hkv, W] each (FP16Slots')
    sequences: list  # per sequence (value groups, blocks n, (key pool, value pool, tier2))


def attend_batch(batch: Phase2Batch, scaling: float, eps_guard: float, *,
                 split: int | None = None, checks: CheckInputs | None = None,
                 certify: CertifyBatch | None = None) -> tuple[Merged, torch.Tensor]:
    """:func:`attend_blocks` for a batch of sequences: one launch of Phase 2 over every
    sequence's blocks and one merge (:func:`reduce_batch`); sequence ``s``'s value groups
    (:class:`~certkv.kernels.triton_sources.BlockSource`) over its ``n_s`` blocks, its pools
    as :class:`FP16Slots` holds them. Returns the merge and the canary ``[S, Hkv, G, W]``."""
    nseq, hkv, g, width, _ = batch.scores.shape
    d = batch.q.shape[-1]
    dev = batch.scores.device
    widths = [n for _, n, _ in batch.sequences]
    split = split or blocks_per_program(sum(widths), hkv, dev)
    plans = [program_groups(src, n) for src, n, _ in batch.sequences]
    fields, layouts, programs, each = batch_groups(plans, split)
    m_b = torch.empty(nseq, hkv, g, width, device=dev)
    l_b, l2_b = torch.empty_like(m_b), torch.empty_like(m_b)
    canary = torch.empty(nseq, hkv, g, width, dtype=torch.bool, device=dev)
    m = torch.empty(nseq, hkv, g, programs, device=dev)
    lsum = torch.empty_like(m)
    acc = torch.empty(nseq, hkv, g, programs, d, device=dev)
    rows = [(*_pool_fields(plan, pool), *own)
            for (_, _, pool), plan, own in zip(batch.sequences, plans, fields, strict=True)]
    rec = records(rows, dev)
    step = (batch.scores.contiguous(), batch.q.float().contiguous(), batch.gate.contiguous(),
            batch.delta.float().contiguous(), [x.contiguous() for x in batch.slots])
    _launch_attend(step, rec, (m_b, l_b, l2_b, canary), (m, lsum, acc), layouts, split,
                   (scaling, eps_guard))
    if certify is not None:  # the certificate reads this step's canary
        certify = certify._replace(x=certify.x._replace(canary_blocks=canary))
    merged = reduce_batch((m_b, l_b, l2_b, m, lsum, acc), widths, each, checks, certify)
    return merged, canary


def _pool_fields(plan, pool) -> tuple:
    """A sequence's record fields before its groups: its tail block's values and strides,
    block counts, FP16 key and value pools and Tier-2 rows with their strides."""
    key_data, value_data, tier2 = pool
    tail_v = tail_data(plan)
    k2, v2 = tier2 or (key_data, key_data)  # never read without a slot <= -2
    assert k2.stride() == v2.stride() and key_data.stride(-1) == value_data.stride(-1) == 1
    return (tail_v, tail_v.stride(0), tail_v.stride(2), plan[0][0].counts, key_data,
            value_data, k2, v2, key_data.stride(0), key_data.stride(1), value_data.stride(0),
            value_data.stride(1), k2.stride(0), k2.stride(1))


def _launch_attend(step, rec, blocks_out, state, layouts, split, scalars) -> None:
    """Phase 2's one launch over every sequence's groups (the ``layouts`` of
    :func:`~certkv.kernels.triton_sources.batch_groups`, read through the records ``rec``):
    block statistics at their indices, one split state per program. The step's tensors go in
    bundles of pointers, their strides and their sequence strides."""
    scores, q, gate, delta, (key_slot, value_slot) = step
    m_b, l_b, l2_b, canary = blocks_out
    m, lsum, acc = state
    nseq, hkv, g, _, bsz = scores.shape
    d = q.shape[-1]
    assert gate.stride() == delta.stride() == m_b.stride() == canary.stride()
    assert key_slot.stride() == value_slot.stride()
    _attend_kernel[(hkv, m.shape[3], nseq)](
        (q, q.stride(0), q.stride(1), q.stride(2)),
        (scores, gate, delta, scores.stride(0), m_b.stride(0), scores.stride(1),
         scores.stride(2), scores.stride(3)),
        (key_slot, value_slot, key_slot.stride(0), key_slot.stride(1)), rec.table,
        (m_b, l_b, l2_b, canary, m_b.stride(1), m_b.stride(2)),
        (m, lsum, acc, m.stride(0), m.stride(1), m.stride(2), acc.stride(0), acc.stride(1),
         acc.stride(2), acc.stride(3)),
        float(scalars[0]), float(scalars[1]),
        G=g, BLOCK_G=triton.next_power_of_2(g), B=bsz, D=d, DOT_C=dot_chunk(d), SPLIT=split,
        LAYOUTS=layouts, KINDS=rec.kinds)
