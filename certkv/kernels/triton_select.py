"""The selection in Triton (issue 55): paper 3.3's key set, rung 1, the value promotions (rung
2) and the page-in plan of a device step in one launch, for the default policy.

:func:`certkv.certify.step_select.select_step` states the selection as about 80 PyTorch
operators (a compiled segment on CUDA); :mod:`certkv.certify.fused_select` computes the same
for the default policy (``AdaptiveTopK`` by mass without the KV-group union, the tight tail
mass, no ``e_key_tol``, exploration, boost or forced blocks, ``LocalThreshold`` values) as a
numba loop nest, and :func:`select` here as one Triton program per kv head, walking its ``G``
query heads: the log-sum-exp and the log-masses, the tightened ``Delta_b``, the blocks in
promotion order (one sort of keys that pack the mass's bits above the block index, so that
ties keep index order as the reference's stable sort), ``K*`` by coverage from the sorted
masses' running sums, rung 1 on the tight tail mass, the value promotions, each head's
radii, and per kv head the plan (FP16 keys any head promoted, FP16 values any head asked
for). The whole row of ``n`` blocks is one tile (``n`` up to 2^20).

Sums and log-sum-exps are FP64 rounded once, as :mod:`~certkv.certify.fused_select` takes
them; a choice can differ from the operators' only where coverage or rung 1's threshold
falls within their FP32 rounding, and every choice is certified alike.
``tests/kernels/test_triton_select.py`` holds it to the segment.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import triton
import triton.language as tl

from certkv.certify.arith import memoised_tensor
from certkv.certify.segment import SelectInputs, Selection
from certkv.kernels.records import integer, pointer, records
from certkv.kernels.triton_certify import _amax, _lse_top, _nmax, _nmin, _shift
from certkv.kernels.triton_merge import block_tile
from certkv.kernels.triton_score import log_or_minus_inf

_INDEX_BITS = 21  # block index bits under a sort key's mass bits (2M blocks per head)


@triton.jit
def _lse(x, live):
    """``logsumexp`` of the FP64 tile ``x`` over ``live`` (``-inf`` if none, NaN with NaN)."""
    shift = _shift(_lse_top(x, live))
    return log_or_minus_inf(tl.sum(tl.where(live, tl.exp(x - shift), 0.0), axis=0)) + shift


@triton.jit
def _top(keys, sorted_keys, pos, k):
    """Whether each block's sort key is among the ``k`` largest (keys are distinct)."""
    lowest = -9223372036854775807 - 1
    threshold = tl.max(tl.where(pos == k - 1, sorted_keys, lowest), axis=0)
    return (k > 0) & (keys >= threshold)


@triton.jit
def _select_kernel(l8_ptr, dch_ptr, lsp_ptr, q_ptr, seq_ptr, par_ptr, logp_ptr, db_ptr,
                   delta_ptr, prom_ptr, expd_ptr, qn_ptr, radii_ptr, plan_ptr, exact_ptr,
                   width, KINDS: tl.constexpr, G: tl.constexpr, D: tl.constexpr,
                   BLOCK_N: tl.constexpr, K_MIN: tl.constexpr, K_MAX: tl.constexpr,
                   CAP: tl.constexpr, EXPAND: tl.constexpr, FACTOR_INT: tl.constexpr,
                   TIGHT: tl.constexpr, INDEX_BITS: tl.constexpr):
    """Grid ``(kv head, sequence)``; the step's tensors contiguous with a leading sequence
    axis (``width`` block columns; the plan ``[2, S, Hkv, W]``), sequence ``s``'s block count
    and what its store holds in its record (:func:`select_batch`)."""
    kv = tl.program_id(0)
    seq = tl.program_id(1)
    hkv = tl.num_programs(0)
    hq = hkv * G
    rec = seq_ptr + seq * len(KINDS)
    n = integer(rec, 0)
    s_kv = integer(rec, 5)
    on_blocks = seq * hq * width
    l8_ptr += on_blocks
    dch_ptr += on_blocks
    lsp_ptr += on_blocks
    logp_ptr += on_blocks
    db_ptr += on_blocks
    prom_ptr += on_blocks
    q_ptr += seq * hq * D
    delta_ptr += seq * hq
    expd_ptr += seq * hq
    qn_ptr += seq * hq
    radii_ptr += seq * 2 * hq
    b = tl.arange(0, BLOCK_N)
    live = b < n
    c = tl.arange(0, D)
    quantized = live & (tl.load(pointer(rec, 1, KINDS[1]) + b, mask=live, other=0) != 0)
    eta = tl.load(pointer(rec, 2, KINDS[2]) + kv * s_kv + b, mask=live, other=0.0)
    vspec = tl.load(pointer(rec, 3, KINDS[3]) + kv * s_kv + b, mask=live, other=0.0)
    kerr = tl.load(pointer(rec, 4, KINDS[4]) + kv * s_kv + b, mask=live, other=0.0)
    scaling = tl.load(par_ptr + 0)
    tau_cov = tl.load(par_ptr + 1)
    factor = tl.load(par_ptr + 2)
    v_tol = tl.load(par_ptr + 3).to(tl.float32)
    n_q = tl.load(pointer(rec, 8, KINDS[8])).to(tl.int32)
    k_cap = tl.minimum(n_q, K_MAX)
    cap = tl.minimum(n_q, CAP)
    v_max = tl.load(pointer(rec, 6, KINDS[6]) + kv)
    v_rad = _nmin(tl.load(pointer(rec, 7, KINDS[7]) + kv), v_max)
    want_k = b < 0  # all False: FP16 keys / values any head of the group asks for
    want_v = b < 0
    for g in tl.static_range(G):
        h = kv * G + g
        row = h * width
        l8 = tl.load(l8_ptr + row + b, mask=live, other=0.0)
        q = tl.load(q_ptr + h * D + c).to(tl.float64)
        q_norm = tl.sqrt(tl.sum(q * q, axis=0)).to(tl.float32)
        log_p = (l8.to(tl.float64) - _lse(l8.to(tl.float64), live)).to(tl.float32)
        p = tl.exp(log_p)
        dch = tl.load(dch_ptr + row + b, mask=live, other=0.0)
        delta_b = _nmin(dch, scaling.to(tl.float32) * q_norm * kerr)
        delta = _lse_top(delta_b, live)  # the largest Delta_b, NaN with NaN
        # promotion order: quantized blocks by mass descending (NaN first), then the rest,
        # ties by index; K* by coverage from the sorted masses' running sums
        bits = tl.where(p != p, 0x7FFFFFFF, p.to(tl.int32, bitcast=True))
        prim = tl.where(quantized, bits, tl.where(live, -1, -2)).to(tl.int64)
        keys = prim * (1 << INDEX_BITS) + ((1 << INDEX_BITS) - 1 - b)
        ordered = tl.sort(keys, descending=True)
        p_sorted = (ordered >> INDEX_BITS).to(tl.int32).to(tl.float32, bitcast=True)
        p64 = tl.where(b < n_q, p_sorted.to(tl.float64), 0.0)  # quantized come first
        p_all = tl.where(live, p.to(tl.float64), 0.0)
        total = tl.sum(p_all, axis=0)
        covered = tl.sum(tl.where(quantized, 0.0, p_all), axis=0)
        target = tau_cov.to(tl.float32) * total.to(tl.float32)
        before = covered + (tl.cumsum(p64, axis=0) - p64)  # covered before the j-th block
        k = tl.sum(((b < n_q) & (before.to(tl.float32) < target)).to(tl.int32), axis=0)
        k = tl.minimum(tl.maximum(k, K_MIN), k_cap)
        # rung 1: min(1, e^{Delta_F} alpha_hat) above 1 - tau_cov widens the key set
        tail = quantized & ~_top(keys, ordered, b, k)
        d = tl.where(tail | ~live, 0.0, delta_b)
        delta_f = _nmax(_amax(d, 0), 0.0)
        log_bound = delta_f.to(tl.float64) + _lse(log_p.to(tl.float64), tail)
        log_bound = tl.where((log_bound != log_bound) | (log_bound < 0.0), log_bound, 0.0)
        k_new = k
        if EXPAND:
            if FACTOR_INT:
                scaled = k * factor.to(tl.int32)
            else:
                scaled = tl.ceil(k.to(tl.float32) * factor.to(tl.float32)).to(tl.int32)
            grown = tl.maximum(tl.minimum(tl.maximum(scaled, k + 1), cap), k)
            k_new = tl.where(tl.exp(log_bound) > 1.0 - tau_cov, grown, k)
        promoted = live & (~quantized | _top(keys, ordered, b, k_new))
        # value promotion (rung 2): LocalThreshold's contribution, tight with the spread
        contribution = p * eta
        if TIGHT:
            lsp = tl.load(lsp_ptr + row + b, mask=live, other=0.0)
            spread = tl.exp(lsp - (l8 - log_p))
            contribution = _nmin(contribution, spread * vspec)
        value = live & (contribution > v_tol) & (eta > 0)
        want_k = want_k | (promoted & quantized)
        want_v = want_v | value
        tl.store(logp_ptr + row + b, log_p, mask=live)
        tl.store(db_ptr + row + b, delta_b, mask=live)
        tl.store(prom_ptr + row + b, promoted.to(tl.int8), mask=live)
        tl.store(delta_ptr + h, delta)
        tl.store(expd_ptr + h, (k_new > k).to(tl.int8))
        tl.store(qn_ptr + h, q_norm)
        tl.store(radii_ptr + h, v_max)
        tl.store(radii_ptr + hq + h, v_rad)
    nseq = tl.num_programs(1)
    tl.store(plan_ptr + (seq * hkv + kv) * width + b, want_k.to(tl.int8), mask=live)
    tl.store(plan_ptr + ((nseq + seq) * hkv + kv) * width + b, want_v.to(tl.int8), mask=live)
    if kv == 0:
        tl.store(exact_ptr + seq * width + b, (~quantized).to(tl.int8), mask=live)


def select(selector, ladder, value_policy, x: SelectInputs) -> Selection:
    """:func:`certkv.certify.step_select.select_step`'s
    :class:`~certkv.certify.segment.Selection` for the default policy
    (:func:`certkv.certify.fused_select.covers`) in one launch; ``x.n_q`` the device path's 0-d
    tensor (read by the kernel: no host sync)."""
    n = x.l8_kv.shape[2]
    batch = x._replace(qg=x.qg[None], l8_kv=x.l8_kv[None], delta_kv=x.delta_kv[None],
                       log_spread_kv=x.log_spread_kv[None])
    return select_batch(selector, ladder, value_policy, batch, [store_fields(x, n)])[0][0]


def store_fields(x: SelectInputs, n: int) -> tuple:
    """A sequence's record for :func:`select_batch`: its block count and what its store holds
    (``x``'s ``quantized, eta, value_spec, key_err`` with their row stride, ``v_max_kv,
    v_rad_kv`` and the quantized count ``n_q``, a 0-d device tensor)."""
    lay = (x.eta, x.value_spec, x.key_err)
    assert all(t.stride() == x.eta.stride() and t.stride(1) == 1 for t in lay)
    return (n, x.quantized.contiguous(), *lay, x.eta.stride(0), x.v_max_kv.contiguous(),
            x.v_rad_kv.contiguous(), x.n_q)


def select_batch(selector, ladder, value_policy, x: SelectInputs, stores: list[tuple]
                 ) -> tuple[list[Selection], Selection]:
    """:func:`select` over a batch in one launch: ``x``'s Phase-1 tensors and queries with a
    leading sequence axis (``[S, Hkv, G, W]``, ``[S, Hkv, G, d]``; its store fields unread),
    ``stores[s]`` sequence ``s``'s record (:func:`store_fields`). Returns each sequence's
    :class:`~certkv.certify.segment.Selection` (views) and the batch's, whose tensors have a
    leading sequence axis (``W`` block columns: sequence ``s``'s first ``n_s``; the plan
    ``[2, S, Hkv, W]``)."""
    nseq, hkv, group, width = x.l8_kv.shape
    hq, d = hkv * group, x.qg.shape[-1]
    dev = x.l8_kv.device
    log_p, delta_b = (torch.empty(nseq, hq, width, device=dev) for _ in range(2))
    promoted = torch.empty(nseq, hq, width, dtype=torch.bool, device=dev)
    delta, q_norm = torch.empty(nseq, hq, device=dev), torch.empty(nseq, hq, device=dev)
    expanded = torch.empty(nseq, hq, dtype=torch.bool, device=dev)
    radii = torch.empty(nseq, 2, hq, device=dev)
    plan = torch.empty(2, nseq, hkv, width, dtype=torch.bool, device=dev)
    exact = torch.empty(nseq, width, dtype=torch.bool, device=dev)
    par = _scalars(float(x.scaling), float(selector.tau_cov), float(ladder.expand_factor),
                   float(value_policy.v_tol), dev)
    cap = 2 * selector.k_max if ladder.k_max is None else ladder.k_max
    rec = records(stores, dev)
    _select_kernel[(hkv, nseq)](
        x.l8_kv.contiguous(), x.delta_kv.contiguous(), x.log_spread_kv.contiguous(),
        x.qg.contiguous(), rec.table, par, log_p, delta_b, delta, promoted, expanded, q_norm,
        radii, plan, exact, width, KINDS=rec.kinds,
        G=group, D=d, BLOCK_N=block_tile(width, 1 << _INDEX_BITS),
        K_MIN=int(selector.k_min),
        K_MAX=int(selector.k_max), CAP=int(cap), EXPAND=bool(ladder.expand),
        FACTOR_INT=float(ladder.expand_factor) == int(ladder.expand_factor),
        TIGHT=value_policy.contribution == "tight", INDEX_BITS=_INDEX_BITS)
    chosen = []
    for s, fields in enumerate(stores):
        n = fields[0]
        own_plan = plan[:, s, :, :n]
        chosen.append(Selection(
            log_p[s, :, :n], delta_b[s, :, :n], delta[s], x.delta_kv[s].reshape(hq, width)[:, :n],
            radii[s, 0], radii[s, 1], q_norm[s].view(hkv, group), promoted[s, :, :n],
            expanded[s], own_plan[1], own_plan, exact[s, :n]))
    whole = Selection(log_p, delta_b, delta, x.delta_kv.reshape(nseq, hq, width), radii[:, 0],
                      radii[:, 1], q_norm.view(nseq, hkv, group), promoted, expanded, plan[1],
                      plan, exact)
    return chosen, whole


@lru_cache(maxsize=64)
def _scalars(scaling: float, tau_cov: float, factor: float, v_tol: float,
             device: torch.device) -> torch.Tensor:
    """The kernel's FP64 scalars on ``device``, one tensor per setting (a step replayed in a
    graph copies nothing)."""
    return memoised_tensor([scaling, tau_cov, factor, v_tol], device)
