"""Rungs 3-4 without a host read (issue 24): dense attention for the flagged query heads only,
in one launch over every kv head, reading the FP16 originals where they live.

The ladder's flags stay on the device: one program per kv head loads its query heads' flags
and returns at once when none is set, so the host never learns which heads went dense. A
flagged group streams its kv head's completed blocks straight from Tier-2 (pinned host memory
on CUDA, read through unified addressing; ordinary memory under ``TRITON_INTERPRET=1``, so the
same code runs in CI) and then the partial tail block from the device, with an online softmax
over the ``G`` query heads of the group at once (each kv head is read once, not ``G`` times).
Only flagged heads' rows of ``out`` are written.

Arithmetic (:data:`FALLBACK_ROUNDING`, arith items 1, 4): each query is divided by a power of
two ``f >= |q|_inf`` (exact, as :func:`~certkv.kernels.reference.prescaled_attention`), logits
are plain FP32 dot products in any order, a weight is ``exp((s - m) f)`` rescaled by the
running maximum once per later block, and numerator and denominator accumulate in FP32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.certify.arith import Rounding
from certkv.kernels.records import integer, pointer, records


def fallback_rounding(block_size: int) -> Rounding:
    """The rounding chain of :func:`dense_flagged` for ``B = block_size`` (arith item 4): a
    weight takes its own exponential and one rescaling per later block (the tail block's
    included: ``2 + N / B``); a numerator term takes the product, ``B - 1`` additions in its
    block, the addition into the running sum, then a rescaling product and an addition per
    later block (``2 N / B``), and the division. Logits: an FP32 dot product in any order and
    the prescaled path's five further roundings (``logit_roundings``)."""
    return Rounding(exps=2, exps_per_token=1 / block_size, depth=block_size + 6,
                    depth_per_token=2 / block_size, logit_roundings=5)


@triton.jit
def _prescale(q):
    """Per row of ``q [GP, D]``: the power of two ``f`` with ``|q|_inf < f`` (at least 1, at most
    2^127), from the exponent bits of the row's largest magnitude (exact: no log2)."""
    top = tl.max(tl.abs(q), axis=1)
    biased = (top.to(tl.int32, bitcast=True) >> 23) & 0xFF  # |top| in [2^(e-127), 2^(e-126))
    exponent = tl.minimum(tl.maximum(biased - 126, 0), 127)
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _online_block(qs, f, k, v, live, m, den, acc, scaling):
    """One block of the online softmax for ``G`` heads: ``qs [GP, D]`` prescaled queries,
    ``k, v [T, D]``, ``live [T]``; returns the updated running maximum and denominator
    ``m, den [GP]`` and numerator ``acc [GP, D]``."""
    s = tl.sum(qs[:, None, :] * k[None, :, :], axis=2) * scaling  # [GP, T]
    s = tl.where(live[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp((m - m_new) * f)
    p = tl.exp((s - m_new[:, None]) * f[:, None])
    den = den * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, den, acc


@triton.jit
def _to_bf16(x):
    """FP32 ``x`` rounded to the nearest BF16, ties to even, NaN kept (as ``torch``'s cast):
    on the bits, since the interpreter's own conversion truncates."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, (bits | 0x400000) >> 16, rounded)
    return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def finish_group(kv, group, hq, pre_ptr, canary_ptr, kvbad_ptr, res_ptr, rung_ptr, flag_ptr,
                 ret_ptr, final_ptr, tol_ptr, seen_ptr, least, GP: tl.constexpr, HP: tl.constexpr,
                 CERTIFIED: tl.constexpr):
    """Kv head ``kv``'s rungs (see the module) from every head's rung before rung 4 and canary
    (``pre, canary``, :func:`certify_head`); writes its heads' ``rung`` (int64), ``flags``
    (and, program 0, the two non-finite flags after them and into ``seen [2]``, or-ed),
    returned E_key, E_val ``ret [2, Hq]``, final E_arith and tolerance level (0). Returns its
    heads' flags ``[GP]``."""
    every = tl.arange(0, HP)
    member = every < hq
    pre = tl.load(pre_ptr + every, mask=member, other=0)
    dense = tl.sum((member & (pre >= 3)).to(tl.int32), axis=0)
    ok = tl.min(tl.where(member, tl.load(canary_ptr + every, mask=member, other=1), 1)
                .to(tl.int32), axis=0) != 0
    q_bad = tl.max(tl.load(pre_ptr + hq + every, mask=member, other=0), axis=0) != 0
    kv_bad = tl.load(kvbad_ptr) != 0
    layer = False
    if CERTIFIED:
        layer = (~ok) | (dense.to(tl.float32) >= least)
    g = tl.arange(0, GP)
    heads = kv * group + g
    mine = g < group
    rung = tl.load(pre_ptr + heads, mask=mine, other=0)
    rung = tl.where(layer, 4, rung)
    flagged = rung >= 3
    e_key = tl.load(res_ptr + heads, mask=mine, other=0.0)
    e_val = tl.load(res_ptr + hq + heads, mask=mine, other=0.0)
    e_arith = tl.load(res_ptr + 2 * hq + heads, mask=mine, other=0.0)
    e_dense = tl.load(res_ptr + 6 * hq + heads, mask=mine, other=0.0)
    final = tl.where(flagged, e_dense, e_arith)
    final = tl.where(q_bad | kv_bad, float("inf"), final)
    tl.store(rung_ptr + heads, rung.to(tl.int64), mask=mine)
    tl.store(flag_ptr + heads, flagged.to(tl.int8), mask=mine)
    tl.store(ret_ptr + heads, tl.where(flagged, 0.0, e_key), mask=mine)
    tl.store(ret_ptr + hq + heads, tl.where(flagged, 0.0, e_val), mask=mine)
    tl.store(final_ptr + heads, final, mask=mine)
    tl.store(tol_ptr + heads, tl.zeros((GP,), tl.int64), mask=mine)
    if kv == 0:
        tl.store(flag_ptr + hq, q_bad.to(tl.int8))
        tl.store(flag_ptr + hq + 1, kv_bad.to(tl.int8))
        one = tl.full([], 1, tl.int8)  # or-ed in: set only, so sequences never race
        tl.store(seen_ptr, one, mask=q_bad)
        tl.store(seen_ptr + 1, one, mask=kv_bad)
    return flagged & mine



@triton.jit
def _dense_flagged_kernel(q_ptr, flag_ptr, out_ptr, outq_ptr, seq_ptr, group, scaling, pre_ptr,
                          canary_ptr, res_ptr, rung_ptr, ret_ptr, final_ptr, tol_ptr, seen_ptr,
                          hq, least, KINDS: tl.constexpr, B: tl.constexpr, D: tl.constexpr,
                          GP: tl.constexpr, FINISH: tl.constexpr, HP: tl.constexpr,
                          CERTIFIED: tl.constexpr, BF16: tl.constexpr):
    """Grid ``(kv head, sequence)``: the step's tensors contiguous with a leading sequence
    axis (:func:`dense_flagged_batch`), sequence ``s``'s Tier-2 rows, tail buffers, block
    counts and non-finite K/V flag in its record."""
    kv = tl.program_id(0).to(tl.int64)  # offsets past 2^31 elements at long contexts
    seq = tl.program_id(1)
    rec = seq_ptr + seq * len(KINDS)
    k2_ptr = pointer(rec, 0, KINDS[0])
    v2_ptr = pointer(rec, 1, KINDS[1])
    tk_ptr = pointer(rec, 2, KINDS[2])
    tv_ptr = pointer(rec, 3, KINDS[3])
    counts_ptr = pointer(rec, 4, KINDS[4])
    s2_h = integer(rec, 5)
    s2_b = integer(rec, 6)
    s2_t = integer(rec, 7)
    st_h = integer(rec, 8)
    st_t = integer(rec, 9)
    rows_at = seq * hq * D
    q_ptr += rows_at
    out_ptr += rows_at
    outq_ptr += rows_at
    flag_ptr += seq * (hq + 2)
    g = tl.arange(0, GP)
    dim = tl.arange(0, D)
    heads = kv * group + g
    member = g < group
    if FINISH:  # the rungs first: the flags come from them
        flagged = finish_group(kv, group, hq, pre_ptr + seq * 2 * hq, canary_ptr + seq * hq,
                               pointer(rec, 10, KINDS[10]), res_ptr + seq * 7 * hq,
                               rung_ptr + seq * hq, flag_ptr, ret_ptr + seq * 2 * hq,
                               final_ptr + seq * hq, tol_ptr + seq * hq, seen_ptr, least, GP, HP,
                               CERTIFIED)
    else:
        flagged = tl.load(flag_ptr + heads, mask=member, other=0) != 0
    rows = heads[:, None] * D + dim[None, :]
    if tl.max(flagged.to(tl.int32), axis=0) != 0:
        q = tl.load(q_ptr + rows, mask=member[:, None], other=0.0).to(tl.float32)
        f = _prescale(q)
        qs = q / f[:, None]
        m = tl.full((GP,), float("-inf"), tl.float32)
        den = tl.zeros((GP,), tl.float32)
        acc = tl.zeros((GP, D), tl.float32)
        t = tl.arange(0, B)
        always = t < B
        for b in range(tl.load(counts_ptr)):  # completed blocks: Tier-2 (host memory on CUDA)
            base = kv * s2_h + b * s2_b + t[:, None] * s2_t + dim[None, :]
            k = tl.load(k2_ptr + base).to(tl.float32)
            v = tl.load(v2_ptr + base).to(tl.float32)
            m, den, acc = _online_block(qs, f, k, v, always, m, den, acc, scaling)
        live = t < tl.load(counts_ptr + 1)  # the partial tail block: device memory
        base = kv * st_h + t[:, None] * st_t + dim[None, :]
        k = tl.load(tk_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.load(tv_ptr + base, mask=live[:, None], other=0.0).to(tl.float32)
        m, den, acc = _online_block(qs, f, k, v, live, m, den, acc, scaling)
        out = acc / den[:, None]
        tl.store(out_ptr + rows, out, mask=(member & flagged)[:, None])
    if FINISH:  # every row of the group in the caller's dtype (round to nearest)
        tl.debug_barrier()
        rows_out = tl.load(out_ptr + rows, mask=member[:, None], other=0.0)
        if BF16:
            rows_out = _to_bf16(rows_out)
        tl.store(outq_ptr + rows, rows_out.to(outq_ptr.dtype.element_ty),
                 mask=member[:, None])


def dense_flagged(q: torch.Tensor, flags: torch.Tensor | None, originals: dict,
                  tail: tuple[torch.Tensor, torch.Tensor], counts: torch.Tensor,
                  out: torch.Tensor, scaling: float, finish=None) -> torch.Tensor:
    """Write dense attention into the rows of ``out`` whose ``flags`` are set; with ``finish``
    (``(Certified, Finished, seen)``: what Phase 2's merge computed of the certificate, where its
    rungs go, the attention's non-finite flags ``seen [2]`` to or into), the flags are the rungs
    :func:`finish_group` decides first, and the output comes back in ``q``'s dtype.

    Args:
        q: ``[Hq, D]`` queries (any float dtype up to FP32), on the device.
        flags: bool ``[Hq]`` on the device: the heads to recompute (rungs 3-4); with
            ``finish``, None (``Finished.flags`` is written).
        originals: ``{"k", "v"}: [Hkv, capacity, B, D]`` FP16 completed blocks, in Tier-2 (host
            memory, pinned on CUDA) or Tier-1 (a lossless store); empty before the first.
        tail: ``(k, v)``, each ``[Hkv, B, D]`` FP16 tail buffers on the device.
        counts: int32 ``[2]`` on the device: how many completed blocks count and how many
            rows of the tail buffers are live (the store's
            :meth:`~certkv.cache.store.TieredKVStore.block_counts`).
        out: ``[Hq, D]`` FP32 on the device, written in place for flagged heads.
    Returns ``out`` (with ``finish``: in ``q``'s dtype). One launch; no host read.
    """
    if finish is not None:
        c, result, seen = finish
        c = c._replace(res=c.res[None], pre=c.pre[None], canary=c.canary[None],
                       kv_bad=[c.kv_bad])
        result = result._replace(**{k: getattr(result, k)[None] for k in result._fields})
        finish = c, result, seen
    return dense_flagged_batch(q[None], None if flags is None else flags[None],
                               [(originals, tail, counts)], out[None], scaling, finish)[0]


def dense_flagged_batch(q: torch.Tensor, flags: torch.Tensor | None, stores: list[tuple],
                        out: torch.Tensor, scaling: float, finish=None) -> torch.Tensor:
    """:func:`dense_flagged` over a batch in one launch: ``q, out [S, Hq, D]``, ``flags
    [S, Hq + 2]`` (a batch of one's may be ``[1, Hq]``), or None with ``finish`` (its tensors
    with a leading sequence axis, one ``kv_bad`` per sequence); ``stores[s]``: sequence
    ``s``'s ``(originals, tail, counts)``.
    Returns ``out`` (with ``finish``: in ``q``'s dtype), ``[S, Hq, D]``."""
    nseq, hq, d = q.shape
    assert out.dtype == torch.float32 and out.is_contiguous()
    q = q.contiguous()
    rows, hkv, block = [], None, None
    kv_bads = finish[0].kv_bad if finish is not None else [None] * nseq
    for (originals, (tail_k, tail_v), counts), kv_bad in zip(stores, kv_bads, strict=True):
        hkv, block = tail_k.shape[0], tail_k.shape[1]
        if not originals:  # no completed block yet: a valid pointer the loop never reads
            k2 = v2 = tail_k[:, None]
        else:
            k2, v2 = originals["k"], originals["v"]
        assert k2.stride(-1) == 1 and k2.stride() == v2.stride() and k2.shape[2] == block
        assert tail_k.stride(-1) == 1 and tail_k.stride() == tail_v.stride()
        rows.append((k2, v2, tail_k, tail_v, counts, k2.stride(0), k2.stride(1), k2.stride(2),
                     tail_k.stride(0), tail_k.stride(1), kv_bad))
    rec = records(rows, q.device)
    group = hq // hkv
    out_q = out if finish is None or q.dtype == torch.float32 else torch.empty_like(q)
    if finish is None:
        fin, least, certified = (flags, flags) + (out,) * 5 + (flags,), 0.0, False
    else:
        c, result, seen = finish
        fin = (c.pre, c.canary, c.res, result.rung, result.returned, result.e_final,
               result.tol_level, seen)
        flags, least, certified = result.flags, c.least, c.certified
    assert all(x.is_contiguous() and x.shape[0] == nseq for x in fin[:-1])
    _dense_flagged_kernel[(hkv, nseq)](
        q, flags, out, out_q, rec.table, group, float(scaling), *fin, hq, float(least),
        KINDS=rec.kinds, B=block, D=d, GP=triton.next_power_of_2(group),
        FINISH=finish is not None, HP=triton.next_power_of_2(hq), CERTIFIED=certified,
        BF16=out_q.dtype == torch.bfloat16)
    return out_q
