"""Triton Phase 1 (paper Alg. 1): block logits, log-masses and Delta_b from key codes.

One launch; grid ``(kv head, program)``, the programs in one group per precision holding blocks
(``triton_sources.program_groups``; the precision a compile-time constant of the group's branch
of the kernel): each program walks ``SPLIT`` of its precision's blocks through its index list
(the last group also the exact tail block); per block it loads the
codes ``[B, d]`` (or the FP16 originals of an exact block) and the per-channel scale/offset once
for all ``G`` query heads of the kv head (GQA-aware), dequantizes in registers (eq. 3) and
writes, at the block's index,

* the logits ``s_{b,t}`` (read again by Phase 2 for the blocks it keeps quantized; the exact
  tail block's FP16 keys are read in place from the store's tail buffer),
* the block log-mass ``l_b = m_b + log sum_t exp(s_{b,t} - m_b)`` (eq. 8's ``p_hat`` before
  normalisation),
* ``Delta_b = scaling * sum_c |q_c| r_c`` (eq. 8) with ``r_c = a sigma_c + b |z_c|`` computed from
  the scales already in registers (the codec's ``bound_coefficients``; 0 on exact blocks),
* the block log-spread ``m_b + log sum_t exp(2 (s_{b,t} - m_b)) / 2`` (``log ||e^{s_b}||_2``,
  the value policy's spread estimate), one more sum over the logits already in registers.

FP32 multiply-adds throughout (no TF32), so the results match the PyTorch reference to FP32
rounding; dot products sum in two levels (:func:`channel_dot`), which the arithmetic
bound counts on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.certify.arith import dot_chunk
from certkv.kernels.records import integer, pointer, real, records
from certkv.kernels.triton_sources import batch_groups, program_groups, tail_data
from certkv.kernels.triton_tune import autotuned


@triton.jit
def load_group_queries(q_ptr, kv, s_qk, s_qg, G: tl.constexpr, BLOCK_G: tl.constexpr,
                       D: tl.constexpr):
    """The ``G`` query heads of kv head ``kv`` as ``[BLOCK_G, D]`` (padding rows are 0)."""
    g = tl.arange(0, BLOCK_G)
    c = tl.arange(0, D)
    return tl.load(q_ptr + kv * s_qk + g[:, None] * s_qg + c[None, :], mask=(g < G)[:, None],
                   other=0.0)


@triton.jit
def channel_dot(q, k, BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                DOT_C: tl.constexpr):
    """``q [BLOCK_G, D] . k [B, D] -> [BLOCK_G, B]`` summed in two levels: chunks of ``DOT_C``
    channels, then across chunks, so no product takes more than ``DOT_C + D / DOT_C - 1``
    roundings whatever order each reduction uses (``arith.dot_depth``)."""
    prod = tl.reshape(q[:, None, :] * k[None, :, :], (BLOCK_G, B, D // DOT_C, DOT_C))
    return tl.sum(tl.sum(prod, axis=3), axis=2)


@triton.jit
def load_codes(ptr, base, t, c, s_t, mask, BITS: tl.constexpr):
    """Codes ``[B, D]`` as FP32 from ``ptr + base`` (row stride ``s_t``): int8 as stored at
    ``BITS = 8``; 3-bit codes 8 to a run of 3 bytes (code ``i`` of a run in bits ``[3 i, 3 i +
    3)`` of its little-endian 24-bit word, :mod:`certkv.quant.packing`: codes 2 and 5 straddle a
    byte, read from two); else unsigned ``BITS``-wide codes packed ``8 // BITS`` per byte along
    the channels (code ``i`` of a byte in its bits ``[i BITS, (i + 1) BITS)``)."""
    if BITS == 8:
        code = tl.load(ptr + base + t[:, None] * s_t + c[None, :], mask=mask, other=0)
    elif BITS == 3:
        bit = 3 * (c % 8)  # the code's first bit in its run's word
        byte = (c // 8) * 3 + bit // 8
        shift = bit % 8
        rows = ptr + base + t[:, None] * s_t + byte[None, :]
        low = tl.load(rows, mask=mask, other=0).to(tl.int32)
        high = tl.load(rows + 1, mask=mask & (shift > 5)[None, :], other=0).to(tl.int32)
        code = ((low | (high << 8)) >> shift[None, :]) & 7
    else:
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(ptr + base + t[:, None] * s_t + c[None, :] // PER, mask=mask, other=0)
        code = (byte >> ((c[None, :] % PER) * BITS).to(tl.uint8)) & ((1 << BITS) - 1)
    return code.to(tl.float32)


@triton.jit
def affine_keys(code, scale, offset, BIAS: tl.constexpr):
    """Per-channel affine key codes ``[B, D]`` (FP32) decoded with their channels' scales and
    offsets ``[D]``: ``(code - BIAS) scale + offset`` (eq. 3)."""
    return (code - BIAS) * scale[None, :] + offset[None, :]


@triton.jit
def channel_terms(scale, offset, a, b):
    """``a scale + b |offset|`` elementwise (per channel ``[D]``, or per group element ``[B,
    D]``), 0 where the scale is 0 (a constant channel or group decodes exactly): a codec's
    channel bound or decode slack from its coefficients ``(a, b)``."""
    return tl.where(scale > 0, a * scale + b * tl.abs(offset), 0.0)


@triton.jit
def inner_group_values(code, scale, word, sym, neg):
    """InnerQ's decode (:func:`certkv.quant.innerq.decode_groups`), elementwise in FP32:
    ``q S + Z`` (one rounding: ``q S`` is exact) with ``Z`` the slot's bits, or ``+-m S``
    where the group is symmetric (``neg``: the element's sign bit in the slot)."""
    mag = code * scale
    return tl.where(sym, tl.where(neg, -mag, mag), mag + word.to(tl.float32, bitcast=True))


@triton.jit
def power_of_two(e):
    """``2^e`` in FP32, exactly, for int32 exponents of normal numbers (the bits themselves)."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def inner_keys(code, scale_ptr, slot_ptr, mode_ptr, norm_ptr, group_base, mode_base,
               norm_base, s_st, rows, bound_a, bound_b, B: tl.constexpr, D: tl.constexpr,
               GROUP: tl.constexpr, NORM: tl.constexpr):
    """One block of InnerQ keys (seed 002: per token, groups of ``GROUP`` channels) from its
    codes ``[B, D]`` (FP32) -> ``(keys [B, D], r [D])``: the keys in original units and the
    channel bound ``max_t (a S + b |Z|) 2^e_c`` over the block's filled tokens ``rows``
    (:meth:`certkv.quant.innerq.InnerQKeyCodec.channel_bound`). A group ``(t, c // GROUP)``
    has its scale and slot at ``group_base + t s_st + c // GROUP`` and its mode bit at
    ``t (D / GROUP) + c // GROUP`` of the block's packed flags."""
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    member = rows[:, None] & (c[None, :] < D)
    at = group_base + t[:, None] * s_st + (c // GROUP)[None, :]
    scale = tl.load(scale_ptr + at, mask=member, other=0.0).to(tl.float32)
    word = tl.load(slot_ptr + at, mask=member, other=0)
    flag = t[:, None] * (D // GROUP) + (c // GROUP)[None, :]
    sym = ((tl.load(mode_ptr + mode_base + flag // 8, mask=member, other=0).to(tl.int32)
            >> (flag % 8)) & 1) != 0
    neg = ((word >> (c % GROUP)[None, :]) & 1) != 0
    k = inner_group_values(code, scale, word, sym, neg)
    zero = tl.where(sym, 0.0, tl.abs(word.to(tl.float32, bitcast=True)))
    r = channel_terms(scale, zero, bound_a, bound_b)
    bound = tl.max(tl.where(member, r, 0.0), axis=0)  # [D]
    if NORM:  # x 2^e_c, exact: keys and bound in original units
        p2 = power_of_two(tl.load(norm_ptr + norm_base + c).to(tl.int32))
        k = k * p2[None, :]
        bound = bound * p2
    return k, bound


U32 = tl.constexpr(2.0**-24)  # FP32's unit roundoff


@triton.jit
def rotate_back(z, basis_ptr, D: tl.constexpr):
    """Rotated coordinates ``z [B, D]`` back to channels, ``z (H D)`` (the rotation codecs'
    decode ``D H^T z`` per token, :mod:`certkv.quant.rotation`), with the FP32 basis ``[D, D]``
    (entries +-1) in one FP32 matmul: IEEE products and sums, no TF32 (the codec's
    ``decode_slack`` bounds any FP32 evaluation of it)."""
    i = tl.arange(0, D)
    basis = tl.load(basis_ptr + i[:, None] * D + i[None, :])
    return tl.dot(z, basis, input_precision="ieee")


@triton.jit
def rotated_back(code, scale_ptr, offset_ptr, at, mask, basis_ptr, D: tl.constexpr):
    """Rotated codes ``[B, D]`` (FP32) decoded with the scale and offset of each element's
    subspace at ``at [B, D]`` (``z = code s + o``, one rounding: ``code s`` is exact) and
    rotated back to channels (:func:`rotate_back`); masked elements decode to 0."""
    z = (code * tl.load(scale_ptr + at, mask=mask, other=0.0).to(tl.float32)
         + tl.load(offset_ptr + at, mask=mask, other=0.0).to(tl.float32))
    return rotate_back(z, basis_ptr, D)


@triton.jit
def rotated_keys(code, scale_ptr, offset_ptr, basis_ptr, base, s_st, rows, bound_a, bound_b,
                 BITS: tl.constexpr, B: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr):
    """One block of rotated keys (seed 004's rotation archive: ``ROT`` subspaces, a scale and
    an offset per token and subspace at ``base + t s_st + j``) from its codes ``[B, D]`` (FP32)
    -> ``(keys [B, D], r [D])``: ``z = code s + o`` rotated back (:func:`rotate_back`), and the
    channel bound, the same on every channel, ``g max_t (a sum_j s_tj + (b + (D + 2) u) sum_j
    zmax_tj)`` over the filled tokens ``rows`` (:meth:`~certkv.quant.rotation.RotatedKeyCodec.
    channel_bound` plus its ``decode_slack``: this rotation is an FP32 one; its few sums over
    subspaces stay within the codec's relative headroom ``a``)."""
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    GR: tl.constexpr = D // ROT
    at = base + t[:, None] * s_st + (c // GR)[None, :]
    keys = rotated_back(code, scale_ptr, offset_ptr, at, rows[:, None] & (c[None, :] < D),
                        basis_ptr, D)
    j = tl.arange(0, ROT)
    sub = base + t[:, None] * s_st + j[None, :]
    held = rows[:, None] & (j[None, :] < ROT)
    s_j = tl.load(scale_ptr + sub, mask=held, other=0.0).to(tl.float32)
    o_j = tl.load(offset_ptr + sub, mask=held, other=0.0).to(tl.float32)
    zmax = tl.maximum(tl.abs(o_j), tl.abs(o_j + ((1 << BITS) - 1) * s_j))
    per_token = GR * (bound_a * tl.sum(s_j, axis=1)
                      + (bound_b + (D + 2) * U32) * tl.sum(zmax, axis=1))
    bound = tl.max(tl.where(rows, per_token, 0.0), axis=0) + c * 0.0
    return keys, bound


@triton.jit
def entry(blk_ptr, slot_ptr, counts_ptr, e, n_live, walked, B: tl.constexpr,
          TAIL: tl.constexpr, CARRIES: tl.constexpr):
    """``(block index, slot, beyond, filled)`` of entry ``e`` of a launch. The launch's blocks
    come first, through the index lists: ``n_live`` of them, or, where the launch ``CARRIES``
    the tail block (or is the tail launch, ``TAIL``), the store's completed blocks
    ``counts[0]`` less the ``walked`` ones of earlier launches; such a launch walks the tail
    block next, at column ``counts[0]``, then the empty blocks after it (a padded layout):
    ``beyond`` marks those entries, read from the tail buffer; ``filled``: the block's token
    slots in use (``counts[1]`` on the tail block, none after it, ``B`` on a completed one).
    An entry past the launch's ``n_live`` is its last one again (in bounds; the caller
    stores nothing for it)."""
    e = tl.minimum(e, n_live - 1)
    tail_blk = tl.load(counts_ptr)
    if CARRIES:  # noqa: SIM108 (a compile-time branch of the kernel, not an expression)
        n_entries = tail_blk - walked + 0 * e
    else:
        n_entries = n_live + 0 * e
    tail_rows = tl.load(counts_ptr + 1)
    if TAIL:
        blk = tail_blk + e
        slot = 0 * e
    else:
        last = tl.maximum(tl.minimum(e, n_entries - 1), 0)
        blk = tl.load(blk_ptr + last)
        slot = tl.load(slot_ptr + last)
    beyond = e >= n_entries  # never where the launch does not carry the tail
    blk = tl.where(beyond, tail_blk + e - n_entries, blk)
    filled = tl.where(beyond, tl.where(e == n_entries, tail_rows, 0), B)
    return blk, slot, beyond, filled

ROPE_REL = tl.constexpr(2.0**-11 + 2.0**-19 + 2.0**-20)  # prerope._REL + _SLACK_REL
ROPE_ABS = tl.constexpr(2.0**-24)  # prerope._ABS
ROPE_FLOOR = tl.constexpr(2.0**-125)  # a flushed subnormal, and prerope's _TINY terms
ROPE_MARGIN = tl.constexpr(1.0 + 2.0**-16)  # this FP32 evaluation against the codec's FP64


@triton.jit
def pair_norm(x, y):
    """``sqrt(x^2 + y^2)`` elementwise in FP32, IEEE square root, scaled by the larger
    magnitude so that no square under- or overflows (0 where both are 0)."""
    big = tl.maximum(tl.abs(x), tl.abs(y))
    ratio = tl.minimum(tl.abs(x), tl.abs(y)) / tl.where(big > 0, big, 1.0)
    return big * tl.sqrt_rn(1.0 + ratio * ratio)


@triton.jit
def rope_keys(code, code_ptr, scale_ptr, offset_ptr, base, meta, s_ct, rows, pos_ptr, cos_ptr,
              sin_ptr, pos_at, half, a, bound, slack, BITS: tl.constexpr, BIAS: tl.constexpr,
              B: tl.constexpr, D: tl.constexpr):
    """One block of pre-RoPE keys (KVQuant's, :mod:`certkv.quant.prerope`) from its inner
    codes ``[B, D]`` (FP32; scale and offset per channel at ``meta``) -> ``(keys [B, D], r
    [D])``: the inner decode ``x`` and its partner channels' ``x'`` (channel ``c + D/2`` mod
    ``D``, its codes read again) rotated to post-RoPE at positions ``pos + t`` with the FP32
    tables ``[P, half]``, ``a (x cos -+ x' sin)``; and the channel bound, the codec's
    ``channel_bound`` plus its ``decode_slack`` (from the inner ``bound`` and ``slack``
    coefficients, the pair norms of the inner bounds ``R`` and slacks ``S`` and the largest
    pair norm ``P`` of the decode, plus ``S`` for the codec's own inner decode), evaluated in
    FP32 and widened by :data:`ROPE_MARGIN` (its few roundings) and :data:`ROPE_FLOOR`."""
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    partner = (c + D // 2) % D
    scale = tl.load(scale_ptr + meta + c).to(tl.float32)
    offset = tl.load(offset_ptr + meta + c).to(tl.float32)
    scale_p = tl.load(scale_ptr + meta + partner).to(tl.float32)
    offset_p = tl.load(offset_ptr + meta + partner).to(tl.float32)
    x = affine_keys(code, scale, offset, BIAS)
    code_p = load_codes(code_ptr, base, t, partner, s_ct, rows[:, None], BITS)
    x_p = affine_keys(code_p, scale_p, offset_p, BIAS)
    row = (tl.load(pos_ptr + pos_at) + t).to(tl.int64)[:, None] * half + (c % (D // 2))[None, :]
    held = rows[:, None] & (c[None, :] < D)
    cos = tl.load(cos_ptr + row, mask=held, other=0.0)
    sin = tl.load(sin_ptr + row, mask=held, other=0.0)
    sign = tl.where(c < D // 2, -1.0, 1.0)
    keys = a * (x * cos + x_p * (sign[None, :] * sin))
    big_r = pair_norm(channel_terms(scale, offset, bound[0], bound[1]),
                      channel_terms(scale_p, offset_p, bound[0], bound[1]))
    big_s = pair_norm(channel_terms(scale, offset, slack[0], slack[1]),
                      channel_terms(scale_p, offset_p, slack[0], slack[1]))
    big_p = tl.max(tl.where(held, pair_norm(x, x_p), 0.0), axis=0) + big_s
    total = a * (big_r + big_s + ROPE_REL * (big_p + big_r + big_s) + ROPE_ABS)
    return keys, total * ROPE_MARGIN + ROPE_FLOOR


@triton.jit
def log_or_minus_inf(total):
    """``log(total)`` of a block's summed weights (NaN stays NaN), and ``-inf`` for a block
    with no filled slot (an empty tail block) without taking ``log(0)`` (which the
    interpreter warns of)."""
    empty = total == 0
    return tl.where(empty, float("-inf"), tl.log(tl.where(empty, 1.0, total)))


@triton.jit
def group_fields(rec, K: tl.constexpr, KINDS: tl.constexpr):
    """One group's arguments from its sequence's record (fields ``K`` to ``K + 32``,
    :func:`~certkv.kernels.triton_sources.batch_groups`), in
    :func:`~certkv.kernels.triton_sources.kernel_groups`' order."""
    return (integer(rec, K), integer(rec, K + 1), pointer(rec, K + 2, KINDS[K + 2]),
            pointer(rec, K + 3, KINDS[K + 3]), pointer(rec, K + 4, KINDS[K + 4]),
            pointer(rec, K + 5, KINDS[K + 5]), pointer(rec, K + 6, KINDS[K + 6]),
            integer(rec, K + 7), integer(rec, K + 8), integer(rec, K + 9), integer(rec, K + 10),
            integer(rec, K + 11), integer(rec, K + 12), integer(rec, K + 13),
            integer(rec, K + 14), real(rec, K + 15), real(rec, K + 16),
            pointer(rec, K + 17, KINDS[K + 17]), integer(rec, K + 18), integer(rec, K + 19),
            pointer(rec, K + 20, KINDS[K + 20]), integer(rec, K + 21), integer(rec, K + 22),
            pointer(rec, K + 23, KINDS[K + 23]), pointer(rec, K + 24, KINDS[K + 24]),
            pointer(rec, K + 25, KINDS[K + 25]), pointer(rec, K + 26, KINDS[K + 26]),
            integer(rec, K + 27), integer(rec, K + 28), integer(rec, K + 29),
            real(rec, K + 30), real(rec, K + 31), real(rec, K + 32))


@autotuned
@triton.jit
def _score_kernel(q_ptr, seq_ptr, s_out, l_out, d_out, ls_out, s_qs, s_qk, s_qg, s_os, s_ok,
                  s_og, s_on, s_ls, s_lk, s_lg, scaling, G: tl.constexpr,
                  BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                  DOT_C: tl.constexpr, SPLIT: tl.constexpr, LAYOUTS: tl.constexpr,
                  KINDS: tl.constexpr):
    """Grid ``(kv head, program, sequence)``: the programs of every precision's blocks of
    every sequence of a batch in one launch. Sequence ``s`` reads its queries and writes its
    results at ``s`` times the sequence strides (``s_qs``, ``s_os``, ``s_ls``) and reads the
    rest from its record (:mod:`~certkv.kernels.records`): its tail block's keys and strides,
    its block counts, then per group of ``LAYOUTS`` its programs ``[first, end)`` and what
    they read (:func:`group_fields`); ``LAYOUTS[k]``: ``(FP16, BITS, BIAS, GROUP, TAIL,
    CARRIES, TOKEN, INNER, NORM, ROT, CODEBOOK, OUTLIERS, ROPE)``
    (:func:`~certkv.kernels.triton_sources.kernel_groups`)."""
    kv = tl.program_id(0)
    p = tl.program_id(1)
    seq = tl.program_id(2)
    rec = seq_ptr + seq * len(KINDS)
    tk_ptr = pointer(rec, 0, KINDS[0])
    counts_ptr = pointer(rec, 3, KINDS[3])
    q = load_group_queries(q_ptr + seq * s_qs, kv, s_qk, s_qg, G, BLOCK_G, D)
    for k in tl.static_range(len(LAYOUTS)):
        src = group_fields(rec, 4 + 33 * k, KINDS)
        if (p >= src[0]) & (p < src[1]):
            _score_split(q, kv, p - src[0], src, tk_ptr, s_out + seq * s_os,
                         l_out + seq * s_ls, d_out + seq * s_ls, ls_out + seq * s_ls, s_ok,
                         s_og, s_on, s_lk, s_lg, integer(rec, 1), integer(rec, 2), counts_ptr,
                         scaling, G, BLOCK_G, B, D, DOT_C, SPLIT, LAYOUTS[k][0],
                         LAYOUTS[k][1], LAYOUTS[k][2], LAYOUTS[k][3], LAYOUTS[k][4],
                         LAYOUTS[k][5], LAYOUTS[k][6], LAYOUTS[k][7], LAYOUTS[k][8],
                         LAYOUTS[k][9], LAYOUTS[k][12])


@triton.jit
def _score_split(q, kv, split, src, tk_ptr, s_out, l_out, d_out, ls_out, s_ok, s_og, s_on,
                 s_lk, s_lg, s_tk, s_tt, counts_ptr, scaling, G: tl.constexpr,
                 BLOCK_G: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                 DOT_C: tl.constexpr, SPLIT: tl.constexpr, FP16: tl.constexpr,
                 BITS: tl.constexpr, BIAS: tl.constexpr, GROUP: tl.constexpr,
                 TAIL: tl.constexpr, CARRIES: tl.constexpr, TOKEN: tl.constexpr,
                 INNER: tl.constexpr, NORM: tl.constexpr, ROT: tl.constexpr,
                 ROPE: tl.constexpr):
    """One program's ``SPLIT`` blocks of one precision (``src``, :func:`~certkv.kernels.
    triton_sources.kernel_groups`); codes with a scale per channel and an offset, or
    (``TOKEN``) symmetric with a scale per token, or (``INNER``) InnerQ's groups of ``GROUP``
    channels per token (:func:`inner_keys`), or (``ROT``) rotated coordinates in ``ROT``
    subspaces (:func:`rotated_keys`), or (``ROPE``) pre-RoPE keys (:func:`rope_keys`)."""
    (_, _, code_ptr, scale_ptr, offset_ptr, blk_ptr, slot_ptr, s_ck, s_cn, s_ct, s_sk, s_sn, s_st,
     n_live, walked, bound_a, bound_b, mode_ptr, s_mk, s_mn, norm_ptr, s_ek, s_en,
     basis_ptr, pos_ptr, cos_ptr, sin_ptr, s_xk, s_xn, half, rope_a, slack_a, slack_b) = src
    g = tl.arange(0, BLOCK_G)
    t = tl.arange(0, B)
    c = tl.arange(0, D)
    gmask = g < G
    q_abs = tl.abs(q)
    for i in range(SPLIT):
        e = split * SPLIT + i
        blk, slot, beyond, filled = entry(blk_ptr, slot_ptr, counts_ptr, e, n_live, walked,
                                          B, TAIL, CARRIES)
        rows = t < filled  # [B]: filled token slots
        base = kv * s_ck + slot * s_cn
        if FP16:  # an exact block: the originals, Delta_b = 0
            k = tl.load(code_ptr + base + t[:, None] * s_ct + c[None, :], mask=rows[:, None],
                        other=0.0).to(tl.float32)
            delta = tl.zeros((BLOCK_G,), tl.float32)
        else:
            code = load_codes(code_ptr, base, t, c, s_ct, rows[:, None], BITS)
            if INNER:  # InnerQ: groups of GROUP channels per token, exponents per channel
                k, bound = inner_keys(code, scale_ptr, offset_ptr, mode_ptr, norm_ptr,
                                      kv * s_sk + slot * s_sn, kv * s_mk + slot * s_mn,
                                      kv * s_ek + slot * s_en, s_st, rows, bound_a, bound_b,
                                      B, D, GROUP, NORM)
            elif ROT > 0:  # rotated coordinates, rotated back in registers
                k, bound = rotated_keys(code, scale_ptr, offset_ptr, basis_ptr,
                                        kv * s_sk + slot * s_sn, s_st, rows, bound_a, bound_b,
                                        BITS, B, D, ROT)
            elif ROPE:  # pre-RoPE codes decoded, rotated to post-RoPE in registers
                k, bound = rope_keys(code, code_ptr, scale_ptr, offset_ptr, base,
                                     kv * s_sk + slot * s_sn, s_ct, rows, pos_ptr, cos_ptr,
                                     sin_ptr, kv * s_xk + slot * s_xn, half, rope_a,
                                     (bound_a, bound_b), (slack_a, slack_b), BITS, BIAS, B, D)
            elif TOKEN:  # (code - bias) s_t, exact; r_c = a max_t s_t on every channel
                scale_t = tl.load(scale_ptr + kv * s_sk + slot * s_sn + t).to(tl.float32)
                k = (code - BIAS) * scale_t[:, None]
                bound = bound_a * tl.max(scale_t, axis=0) + c * 0.0
            else:
                scale = tl.load(scale_ptr + kv * s_sk + slot * s_sn + c).to(tl.float32)
                offset = tl.load(offset_ptr + kv * s_sk + slot * s_sn + c).to(tl.float32)
                k = affine_keys(code, scale, offset, BIAS)  # eq. 3, in registers
                bound = channel_terms(scale, offset, bound_a, bound_b)
            delta = tl.sum(q_abs * bound[None, :], axis=1) * scaling  # eq. 8, r_c = bound
        if beyond:  # the tail block (FP16 keys from the store's tail buffer) or an empty one
            k = tl.load(tk_ptr + kv * s_tk + t[:, None] * s_tt + c[None, :],
                        mask=rows[:, None], other=0.0).to(tl.float32)
            delta = tl.zeros((BLOCK_G,), tl.float32)
        s = channel_dot(q, k, BLOCK_G, B, D, DOT_C) * scaling  # [BLOCK_G, B]
        s = tl.where(rows[None, :], s, float("-inf"))  # empty tail slots
        live_g = gmask & ((g * 0 + e) < n_live)
        tl.store(s_out + kv * s_ok + g[:, None] * s_og + blk * s_on + t[None, :], s,
                 mask=live_g[:, None])
        m = tl.max(s, axis=1)
        m = tl.where(m == float("-inf"), 0.0, m)  # no finite logit (non-finite inputs)
        w = tl.exp(s - m[:, None])
        log_mass = m + log_or_minus_inf(tl.sum(w, axis=1))
        log_spread = m + 0.5 * log_or_minus_inf(tl.sum(w * w, axis=1))
        tl.store(l_out + kv * s_lk + g * s_lg + blk, log_mass, mask=live_g)
        tl.store(d_out + kv * s_lk + g * s_lg + blk, delta, mask=live_g)
        tl.store(ls_out + kv * s_lk + g * s_lg + blk, log_spread, mask=live_g)


MAX_SPLIT = 64  # most blocks one program walks on a GPU (bounds the rounding chain)


def blocks_per_program(n: int, hkv: int, device: torch.device, waves: int = 4) -> int:
    """Blocks each program walks (power of two, 1-``MAX_SPLIT``): enough programs for ``waves``
    per SM on a GPU, few large ones in the interpreter. Used by Phase 1 and Phase 2."""
    if device.type != "cuda":
        return 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(MAX_SPLIT, triton.next_power_of_2(triton.cdiv(n * hkv, waves * sms))))


def score_blocks(q: torch.Tensor, sources: list, n: int, block_size: int, scaling: float,
                 split: int | None = None):
    """Phase 1 of ``q [Hkv, G, d]`` over ``n`` blocks given as :class:`BlockSource` groups (one
    per precision, then the exact tail block; ``triton_sources.block_sources``) in one launch,
    ``split`` blocks per program (``None``: :func:`blocks_per_program`).

    Returns ``(s [Hkv, G, n, B], log_mass, delta_b, log_spread [Hkv, G, n])``, all FP32, with
    ``-inf`` logits on empty tail slots and ``Delta_b = 0`` on exact blocks. Columns after the
    tail block's (``n`` above the store's blocks and tail: a padded layout) are empty blocks:
    ``-inf`` logits, log-mass and log-spread, ``Delta_b = 0``.
    """
    return tuple(x[0] for x in score_batch(q[None], [sources], [n], block_size, scaling,
                                           split))


def score_batch(q: torch.Tensor, sources: list[list], widths: list[int], block_size: int,
                scaling: float, split: int | None = None):
    """:func:`score_blocks` for a batch of sequences in one launch: ``q [S, Hkv, G, d]``,
    sequence ``s``'s groups ``sources[s]`` over ``widths[s]`` blocks. Returns the same four
    tensors with a leading sequence axis, ``W = max(widths)`` block columns: sequence ``s``'s
    are its first ``widths[s]`` (the others are not written)."""
    nseq, hkv, group, _ = q.shape
    width = max(widths)
    q = q.float().contiguous()
    dev = q.device
    s = torch.empty(nseq, hkv, group, width, block_size, device=dev, dtype=torch.float32)
    log_mass = torch.empty(nseq, hkv, group, width, device=dev, dtype=torch.float32)
    delta = torch.empty_like(log_mass)
    log_spread = torch.empty_like(log_mass)
    split = split or blocks_per_program(sum(widths), hkv, dev)
    plans = [program_groups(src, n) for src, n in zip(sources, widths, strict=True)]
    fields, layouts, programs, _ = batch_groups(plans, split)
    rows = []
    for src, plan, own in zip(sources, plans, fields, strict=True):
        tail_k = tail_data(plan)
        rows.append((tail_k, tail_k.stride(0), tail_k.stride(2), src[0].counts, *own))
    rec = records(rows, dev)
    _score_kernel[(hkv, programs, nseq)](
        q, rec.table, s, log_mass, delta, log_spread, q.stride(0), q.stride(1), q.stride(2),
        s.stride(0), s.stride(1), s.stride(2), s.stride(3), log_mass.stride(0),
        log_mass.stride(1), log_mass.stride(2), float(scaling),
        G=group, BLOCK_G=triton.next_power_of_2(group), B=block_size, D=q.shape[3],
        DOT_C=dot_chunk(q.shape[3]), SPLIT=split, LAYOUTS=layouts, KINDS=rec.kinds)
    return s, log_mass, delta, log_spread
