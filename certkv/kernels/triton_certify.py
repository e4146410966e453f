"""The certificate in Triton (issue 55): eq. 15, Cor. 4.2 and E_arith as the epilogue of Phase
2's merge, and the rungs finished by the fallback kernel, so that a device step launches no
segment and no operator for them.

:func:`certify_head` evaluates, for one query head, what
:func:`certkv.certify.step_certify.certify_step` states as about 260 PyTorch operators and
:mod:`certkv.certify.fused_cpu` as a numba loop nest: the three-lane key bound (as returned,
the paper's form, widened by rounding), the per-block TV bound in two lanes, Cor. 4.2's E_val
and the paper's, E_arith's linear form (:func:`certkv.certify.arith.composition_weights`), the
tail mass, ``K*``, the FP16 value blocks, the head's rung before the layer's decision (rung 4),
its canary, and the dense path's E_arith for the fallback. It is a line-by-line port of
:func:`certkv.certify.fused_cpu._kernel`: every input widened exactly to FP64, each result
rounded once to FP32, NaN propagated as PyTorch's ``minimum`` and ``amax`` do. Triton has no
``expm1``, ``log1p`` or ``tanh`` that runs under ``TRITON_INTERPRET=1``, so they are written
here from ``exp`` and ``log`` with series where cancellation would cost digits (relative error
below ``1e-12``, far inside the FP32 rounding the arithmetic bound allows for every term).

:func:`finish_group` is the fallback kernel's prologue for one kv head: the layer's rung 4
(any canary failed, or at least ``layer_dense_fraction`` of heads dense), the flags, the
returned E_key and E_val, the final E_arith and the non-finite flags, as
:func:`~certkv.certify.step_certify.rungs`, :func:`~certkv.certify.step_certify.returned` and
:func:`~certkv.certify.step_certify.device_arith` state them. Every program reads every head's
rung and canary (a few hundred bytes) and decides alike, so no program waits for another.

``tests/kernels/test_triton_certify.py`` holds both to the PyTorch segment and the contract
tests hold the device path to FP64 attention.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from certkv.certify.arith import (
    FP16_MAX,
    LOG_ULPS,
    ROUND_UP_ABS,
    ROUND_UP_REL,
    TINY,
    U32,
    ArithSpec,
    StepCoefficients,
    cast_error,
    gamma,
    logit_rounding_form,
    magnitude_factor,
    memoised_tensor,
)
from certkv.certify.fused_cpu import CAST_LIMIT
from certkv.certify.segment import CertifyInputs, CertifyOutputs
from certkv.kernels.triton_score import log_or_minus_inf


@triton.jit
def _nmin(a, b):
    """``torch.minimum``: NaN if either is NaN."""
    return tl.where((a != a) | (b != b), a + b, tl.minimum(a, b))


@triton.jit
def _nmax(a, b):
    """``torch.maximum``: NaN if either is NaN."""
    return tl.where((a != a) | (b != b), a + b, tl.maximum(a, b))


@triton.jit
def _amax(x, axis: tl.constexpr):
    """``amax`` of a tile: NaN if any element is NaN."""
    nan = tl.sum(tl.where(x != x, x, 0.0), axis=axis)
    return tl.max(x, axis=axis) + nan


@triton.jit
def _expm1(x):
    """``e^x - 1`` in FP64: a Taylor polynomial below ``|x| = 1e-3``, else ``exp(x) - 1``
    (cancellation there costs at most 1e-13 relatively)."""
    small = x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0)))))
    return tl.where(tl.abs(x) < 1e-3, small, tl.exp(x) - 1.0)


@triton.jit
def _log1p(x):
    """``log(1 + x)`` in FP64 for ``x >= -1``: a series below ``|x| = 1e-3``."""
    small = x * (1.0 - x * (0.5 - x * (1.0 / 3.0 - x * (0.25 - x * 0.2))))
    return tl.where(tl.abs(x) < 1e-3, small, tl.log(1.0 + x))


@triton.jit
def _tanh(x):
    """``tanh x`` in FP64: ``-expm1(-2|x|) / (2 + expm1(-2|x|))`` with the sign of ``x``."""
    e = _expm1(-2.0 * tl.abs(x))
    t = -e / (2.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _log_sigmoid(x):
    """``min(x, 0) - log1p(e^{-|x|})``."""
    return tl.where(x == x, tl.minimum(x, 0.0) - _log1p(tl.exp(-tl.abs(x))), x)


@triton.jit
def _widen(x, slack, log_u):
    """:func:`certkv.certify.arith._widen`: ``x (1 + 8 u sign x) + slack``."""
    sign = tl.where(x > 0, 1.0, tl.where(x < 0, -1.0, 0.0))
    sign = tl.where(x != x, x, sign)
    return x * (1.0 + log_u * sign) + slack


@triton.jit
def _exp_where(mask, x):
    """``exp(x)`` where ``mask``, 0 elsewhere, never evaluating ``exp`` of a masked lane (whose
    value may overflow: the interpreter's NumPy would warn of it)."""
    return tl.exp(tl.where(mask, x, float("-inf")))


@triton.jit
def _key_bound(v, delta, delta_tail, log_alpha, exponent, cap_logit, tv_cap):
    """:func:`~certkv.certify.bounds.key_error_bound` for one head and lane (FP64)."""
    log_tail = _nmin(exponent * delta + log_alpha, 0.0)
    log_tail = _nmin(log_tail, _log_sigmoid(cap_logit))
    x = 2.0 * delta_tail
    log_a3 = log_tail + (x + log_or_minus_inf(-_expm1(-x)))
    log_a3 = tl.where(log_tail == float("-inf"), log_tail, log_a3)
    tv = _nmin(_tanh(delta_tail / 2.0), tl.exp(_nmin(log_a3, 0.0)))
    return 2.0 * v * _nmin(tv, tv_cap)


@triton.jit
def _tv_terms(rho, d, lam, spread, live):
    """One tile's sums of :func:`~certkv.certify.bounds.block_tv_bound`: ``sum phi min(rho
    d, spread lam)``, ``sum rho expm1(-d)`` and ``max d`` over the ``live`` blocks (FP64)."""
    dc = tl.where(d != d, d, tl.minimum(tl.maximum(d, 2.2250738585072014e-308),
                                        1.7976931348623157e308))
    phi = _expm1(dc) / dc
    per = _nmin(rho * d, spread * lam)
    num = tl.sum(tl.where(live & (per > 0), phi * per, 0.0), axis=0)
    kept = tl.sum(tl.where(live, rho * _expm1(-d), 0.0), axis=0)
    top = _amax(tl.where(live, d, float("-inf")), 0)
    return num, kept, top


@triton.jit
def _tv_bound(num, kept, top):
    """:func:`~certkv.certify.bounds.block_tv_bound` from :func:`_tv_terms`' sums."""
    den = _nmax(1.0 + kept, tl.exp(-top))
    den = tl.where(den != den, den, tl.maximum(den, 2.2250738585072014e-308))
    tv = num / den
    return tl.where(tv != tv, 1.0, tl.minimum(tv, 1.0))


@triton.jit
def _lse_top(x, live):
    """The largest of ``x`` over ``live`` (``-inf`` if none, NaN with NaN): a log-sum-exp's
    top."""
    return _amax(tl.where(live, x, float("-inf")), 0)


@triton.jit
def _shift(top):
    """The log-sum-exp's shift: 0 for an infinite maximum (no term, or an infinite one)."""
    return tl.where(tl.abs(top) == float("inf"), 0.0, top)


@triton.jit
def _logit_tile(start, n, row, l8_ptr, l16_ptr, logp_ptr, db_ptr, dch_ptr, prom_ptr,
                exact_ptr, BLOCK_N: tl.constexpr):
    """Blocks ``start .. start + BLOCK_N`` of a head's row: indices, live, promoted, exact and
    INT8 tail masks, and FP64 ``l8, l16, log_p, delta_b, delta_chan``."""
    b = start + tl.arange(0, BLOCK_N)
    live = b < n
    prom = tl.load(prom_ptr + row + b, mask=live, other=0) != 0
    exact = tl.load(exact_ptr + b, mask=live, other=0) != 0
    tail = live & ~(prom | exact)
    l8 = tl.load(l8_ptr + row + b, mask=live, other=0.0).to(tl.float64)
    l16 = tl.load(l16_ptr + row + b, mask=live, other=0.0).to(tl.float64)
    lp = tl.load(logp_ptr + row + b, mask=live, other=0.0).to(tl.float64)
    db = tl.load(db_ptr + row + b, mask=live, other=0.0).to(tl.float64)
    dch = tl.load(dch_ptr + row + b, mask=live, other=0.0).to(tl.float64)
    return b, live, prom, exact, tail, l8, l16, lp, db, dch


@triton.jit
def certify_head(h, n, s_h, l8_ptr, l16_ptr, rho_ptr, sp_ptr, logp_ptr, db_ptr, dch_ptr,
                 prom_ptr, exact_ptr, canb_ptr, vkv_ptr, s_vkv, eta_ptr, vspec_ptr, kspec_ptr,
                 s_kv, delta_ptr, vmax_ptr, vrad_ptr, qnorm_ptr, q_ptr, kam_ptr, etamax_ptr,
                 vmaxkv_ptr, par_ptr, w_ptr, out, ranking, boundary, expanded_ptr, res_ptr,
                 resi_ptr, pre_ptr, canary_ptr,
                 G: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 CERTIFIED: tl.constexpr, CANARY: tl.constexpr):
    """The certificate of query head ``h`` (see the module), after Phase 2 wrote its block
    masses ``rho``, log-masses ``l16`` and spreads at row ``h * s_h`` of the ``[Hq, n]``
    tensors; ``out [D]`` its FP32 output (registers), ``ranking, boundary`` its checks.

    Inputs (row ``h * s_h``): ``l8, log_p, delta_b`` (tightened), ``delta_chan`` FP32,
    ``promoted, canary_blocks`` bool; ``exact [n]`` bool; per kv head ``value_kv`` bool (row
    ``kv * s_vkv``) and ``eta, value_spec, key_spec`` FP32 (row ``kv * s_kv``); FP32 ``[Hq]``
    ``delta, v_max, v_rad, q_norm``; ``q [Hq, D]`` the caller's dtype; ``key_abs_max [Hkv, D]``,
    ``eta_max, v_max_kv [Hkv]``; ``par`` the FP64 scalars (:func:`scalars`), ``w [7]`` the
    linear form's weights. Writes FP32 ``res [7, Hq]``: E_key, E_val, E_arith, tail mass, the
    paper's E_key and E_val, the dense path's E_arith; int64 ``resi [2, Hq]``: ``K*``, FP16
    value blocks; int32 ``pre [2, Hq]``: the rung before rung 4, ``q`` not finite; bool
    ``canary [Hq]``."""
    hq = tl.num_programs(0)
    kv = h // G
    row = h * s_h
    krow = kv * s_kv
    c = tl.arange(0, D)
    # the scalars (FP64): arith items 1, 2, 5 and the dense path's item 1, 4, 6
    scaling = tl.load(par_ptr + 0)
    exponent = tl.load(par_ptr + 1)
    eps_a = tl.load(par_ptr + 2)
    eps_b = tl.load(par_ptr + 3)
    eps_c = tl.load(par_ptr + 4)
    mag_factor = tl.load(par_ptr + 5)
    kappa0 = tl.load(par_ptr + 6)
    rho_rel = tl.load(par_ptr + 7)
    spread_rel = tl.load(par_ptr + 8)
    g = tl.load(par_ptr + 9)
    lu = tl.load(par_ptr + 10)  # 8 u: a computed log quantity's own rounding (_widen)
    tiny = tl.load(par_ptr + 11)
    up_rel = tl.load(par_ptr + 12)
    up_abs = tl.load(par_ptr + 13)
    # pass 1: the log-sum-exps' maxima, the tail's maxima, K*, E_val (Cor. 4.2)
    lowest = tl.full([], float("-inf"), tl.float64)
    top_u = lowest
    top_uc = lowest
    top_z = lowest
    top_a = lowest
    d_t = lowest
    d_t_chan = lowest
    d_chan_max = lowest
    e_val = tl.full([], 0.0, tl.float64)
    paper_val = e_val
    sigma_max = lowest
    n_val = 0
    k_star = 0
    violated = 0
    for start in range(0, n, BLOCK_N):
        b, live, prom, exact, tail, l8, l16, lp, db, dch = _logit_tile(
            start, n, row, l8_ptr, l16_ptr, logp_ptr, db_ptr, dch_ptr, prom_ptr, exact_ptr,
            BLOCK_N)
        top_u = _nmax(top_u, _lse_top(l8 + db, tail))
        top_uc = _nmax(top_uc, _lse_top(l8 + dch, tail))
        top_z = _nmax(top_z, _lse_top(l16, live & prom))
        top_a = _nmax(top_a, _lse_top(lp, tail))
        d_t = _nmax(d_t, _amax(tl.where(live, tl.where(tail, db, 0.0), float("-inf")), 0))
        d_t_chan = _nmax(d_t_chan,
                         _amax(tl.where(live, tl.where(tail, dch, 0.0), float("-inf")), 0))
        d_chan_max = _nmax(d_chan_max, _amax(tl.where(live, dch, float("-inf")), 0))
        k_star += tl.sum((live & prom & ~exact).to(tl.int32), axis=0)
        fp16 = tl.load(vkv_ptr + kv * s_vkv + b, mask=live, other=0) != 0
        eta_b = tl.where(fp16, 0.0, tl.load(eta_ptr + krow + b, mask=live, other=0.0)
                         .to(tl.float64))
        sigma = tl.where(fp16, 0.0, tl.load(vspec_ptr + krow + b, mask=live, other=0.0)
                         .to(tl.float64))
        rho = tl.load(rho_ptr + row + b, mask=live, other=0.0).to(tl.float64)
        spread = tl.load(sp_ptr + row + b, mask=live, other=0.0).to(tl.float64)
        e_val += tl.sum(tl.where(live, _nmin(rho * eta_b, spread * sigma), 0.0), axis=0)
        paper_val += tl.sum(tl.where(live, rho * eta_b, 0.0), axis=0)
        sigma_max = _nmax(sigma_max, _amax(tl.where(live, sigma, float("-inf")), 0))
        n_val += tl.sum((live & fp16).to(tl.int32), axis=0)
        bad = tl.load(canb_ptr + row + b, mask=live, other=0) != 0
        violated += tl.sum(bad.to(tl.int32), axis=0)
    # item 1: S, eps, kappa (and the dense path's eps, with its prescaled query)
    qh = tl.load(q_ptr + h * D + c).to(tl.float64)
    kam = tl.load(kam_ptr + kv * D + c).to(tl.float64)
    mag = tl.sum(tl.abs(qh) * kam, axis=0) * mag_factor
    dh = tl.load(delta_ptr + h).to(tl.float64)
    eps = eps_a * (mag + dh) + (eps_b * dh + eps_c)
    kappa = kappa0 + lu * (mag + dh)
    # pass 2: the log-sum-exps U_T (tight, eq. 8's Delta_b), Z_F, alpha_hat, and the per-block
    # TV bound as returned and at the widened inputs (item 2)
    s_u = _shift(top_u)
    s_uc = _shift(top_uc)
    s_z = _shift(top_z)
    s_a = _shift(top_a)
    sum_u = tl.full([], 0.0, tl.float64)
    sum_uc = sum_u
    sum_z = sum_u
    sum_a = sum_u
    grow = tl.exp(2.0 * eps)
    lam_h = scaling * tl.load(qnorm_ptr + h).to(tl.float64)
    num0 = sum_u
    kept0 = sum_u
    top0 = tl.full([], float("-inf"), tl.float64)
    num1 = sum_u
    kept1 = sum_u
    top1 = top0
    for start in range(0, n, BLOCK_N):
        b, live, prom, exact, tail, l8, l16, lp, db, dch = _logit_tile(
            start, n, row, l8_ptr, l16_ptr, logp_ptr, db_ptr, dch_ptr, prom_ptr, exact_ptr,
            BLOCK_N)
        sum_u += tl.sum(_exp_where(tail, l8 + db - s_u), axis=0)
        sum_uc += tl.sum(_exp_where(tail, l8 + dch - s_uc), axis=0)
        sum_z += tl.sum(_exp_where(live & prom, l16 - s_z), axis=0)
        sum_a += tl.sum(_exp_where(tail, lp - s_a), axis=0)
        rho = tl.load(rho_ptr + row + b, mask=live, other=0.0).to(tl.float64)
        spread = tl.load(sp_ptr + row + b, mask=live, other=0.0).to(tl.float64)
        lam = lam_h * tl.load(kspec_ptr + krow + b, mask=live, other=0.0).to(tl.float64)
        n0, k0, t0 = _tv_terms(rho, tl.where(tail, db, 0.0), lam, spread, live)
        rho_w = tiny * grow + rho * ((1.0 + rho_rel) * grow)
        spread_w = tiny * grow + spread * ((1.0 + spread_rel) * grow)
        n1, k1, t1 = _tv_terms(rho_w, tl.where(tail, db + eps, 0.0), lam * (1.0 + 2.0 * g),
                               spread_w, live)
        num0 += n0
        kept0 += k0
        top0 = _nmax(top0, t0)
        num1 += n1
        kept1 += k1
        top1 = _nmax(top1, t1)
    log_u = log_or_minus_inf(sum_u) + s_u  # an empty sum: -inf, without log(0)
    log_u_chan = log_or_minus_inf(sum_uc) + s_uc
    log_z = log_or_minus_inf(sum_z) + s_z
    log_alpha = log_or_minus_inf(sum_a) + s_a
    cap = tl.where(log_u == float("-inf"), log_u, log_u - log_z)
    cap_chan = tl.where(log_u_chan == float("-inf"), log_u_chan, log_u_chan - log_z)
    tv_block = _tv_bound(num0, kept0, top0)
    tv_block_plus = _tv_bound(num1, kept1, top1)
    # E_key (eq. 15 with both caps): returned, the paper's form, widened (item 2)
    vm = tl.load(vmax_ptr + h).to(tl.float64)
    vr = tl.load(vrad_ptr + h).to(tl.float64)
    e_key = _key_bound(vr, dh, d_t, log_alpha, exponent, cap, tv_block).to(tl.float32)
    paper_key = _key_bound(vm, d_chan_max, d_t_chan, log_alpha, exponent, cap_chan,
                           float("inf")).to(tl.float32)
    tv_plus = _key_bound(0.5, dh + eps, d_t + eps, _widen(log_alpha, kappa, lu), exponent,
                         _widen(cap, 2.0 * eps + 2.0 * kappa, lu), tv_block_plus)
    e_val32 = e_val.to(tl.float32)
    # E_arith (items 3, 4, 6): the linear form of composition_weights
    out_norm = tl.sqrt(tl.sum(out.to(tl.float64) * out.to(tl.float64), axis=0))
    key_plus = 2.0 * _nmin(vr, vm) * (tv_plus + _tanh(eps / 2.0))
    eta_max = tl.load(etamax_ptr + kv).to(tl.float64)
    total = (tl.load(w_ptr + 0) * key_plus + tl.load(w_ptr + 1) * e_val32.to(tl.float64)
             + tl.load(w_ptr + 2) * eta_max + tl.load(w_ptr + 3) * sigma_max
             + tl.load(w_ptr + 4) * vm + tl.load(w_ptr + 5) * out_norm + tl.load(w_ptr + 6))
    e_arith = _round_up(total - e_key.to(tl.float64), up_rel, up_abs)
    # the dense path's E_arith (rungs 3-4 on the device: arith items 1, 4, 6)
    v = tl.load(vmaxkv_ptr + kv).to(tl.float64)
    prescale = 2.0 * tl.maximum(tl.max(tl.abs(qh), axis=0), 1.0)
    eps_d = tl.load(par_ptr + 14) * mag + tl.load(par_ptr + 15) * (
        1.0 + tl.load(par_ptr + 16) * prescale)
    acc = tl.load(par_ptr + 17) * v
    e_dense = _round_up((2.0 * v * _tanh(eps_d / 2.0) + acc + tl.load(par_ptr + 18) * (v + acc)
                         + tl.load(par_ptr + 19)) * tl.load(par_ptr + 20) + tiny * (v + 1.0),
                        up_rel, up_abs)
    # the rung before the layer's decision, the canary, q's finiteness
    limit = tl.load(par_ptr + 21).to(tl.float32)
    bound = (e_key + e_val32) + e_arith
    finite = (tl.min((tl.abs(out) < limit).to(tl.int32), axis=0) != 0) & (bound < float("inf"))
    r = tl.maximum(tl.load(expanded_ptr + h).to(tl.int32), tl.where(n_val > 0, 2, 0))
    passed = (ranking & boundary & finite) if CERTIFIED else finite
    r = tl.where(passed, r, 3)
    canary_ok = True
    if CERTIFIED and CANARY:
        canary_ok = violated == 0
    q_bad = tl.min((tl.abs(qh) < float("inf")).to(tl.int32), axis=0) == 0
    tl.store(res_ptr + h, e_key)
    tl.store(res_ptr + hq + h, e_val32)
    tl.store(res_ptr + 2 * hq + h, e_arith)
    tl.store(res_ptr + 3 * hq + h, tl.exp(log_alpha).to(tl.float32))
    tl.store(res_ptr + 4 * hq + h, paper_key)
    tl.store(res_ptr + 5 * hq + h, paper_val.to(tl.float32))
    tl.store(res_ptr + 6 * hq + h, e_dense)
    tl.store(resi_ptr + h, k_star.to(tl.int64))
    tl.store(resi_ptr + hq + h, n_val.to(tl.int64))
    tl.store(pre_ptr + h, r)
    tl.store(pre_ptr + hq + h, q_bad.to(tl.int32))
    tl.store(canary_ptr + h, canary_ok.to(tl.int8))


@triton.jit
def _round_up(x, up_rel, up_abs):
    """:func:`certkv.certify.arith._round_up_fp32` of ``max(x, 0)`` (NaN stays NaN)."""
    x = tl.where(x == x, tl.maximum(x, 0.0), x)
    return (x * (1.0 + up_rel) + up_abs).to(tl.float32)


@lru_cache(maxsize=64)
def scalars(spec: ArithSpec, coef: StepCoefficients, exponent: float,
            device: torch.device) -> torch.Tensor:
    """The certificate's FP64 scalars on ``device``, in :func:`certify_head`'s order (memoised
    per step setting, one copy each: a step replayed in a graph copies nothing). ``coef``: the
    step's coefficients as host floats."""
    d = spec.head_dim
    eps_a, eps_b, eps_c = logit_rounding_form(spec.rounding.logit_gamma(d), spec.scaling, d)
    dense_a, _, _ = logit_rounding_form(spec.dense_rounding.logit_gamma(d, spec.dense_u),
                                        spec.scaling, d)
    cast_a, cast_b = cast_error(d, spec.out_dtype)
    under = spec.scaling * TINY * d  # item 1's underflow: under (1 + FP16_MAX prescale)
    values = [spec.scaling, exponent, eps_a, eps_b, eps_c, magnitude_factor(spec.scaling, d),
              float(coef.kappa), float(coef.rho_rel), float(coef.spread_rel), gamma(d + 8),
              LOG_ULPS * U32, TINY, ROUND_UP_REL, ROUND_UP_ABS,
              dense_a, under, FP16_MAX, float(coef.dense_acc), cast_a, cast_b, 1 + 4 * U32,
              CAST_LIMIT.get(spec.out_dtype, math.inf)]
    return memoised_tensor(values, device)


class Certified(NamedTuple):
    """What the merge's epilogue wrote (device tensors, per query head) and the fallback
    kernel finishes (:func:`finish_group`)."""

    res: torch.Tensor  # FP32 [7, Hq]: e_key, e_val, e_arith, tail mass, paper's, e_dense
    resi: torch.Tensor  # int64 [2, Hq]: K*, FP16 value blocks
    pre: torch.Tensor  # int32 [2, Hq]: rung before rung 4, q not finite
    canary: torch.Tensor  # bool [Hq]
    kv_bad: torch.Tensor  # 0-d bool
    certified: bool  # a certified step (else naive: no checks, canary or rung 4)
    least: float  # heads on rungs 3-4 that make the layer dense (rung 4)


class Finished(NamedTuple):
    """Where the fallback kernel writes the rungs (:func:`~certkv.kernels.triton_fallback.
    finish_group`), device tensors the certificate already holds."""

    rung: torch.Tensor  # int64 [Hq]
    flags: torch.Tensor  # bool [Hq + 2]: rungs 3-4, then non-finite q and K/V
    returned: torch.Tensor  # FP32 [2, Hq]: E_key, E_val as returned (0 on rungs 3-4)
    e_final: torch.Tensor  # FP32 [Hq]: E_arith after the fallback
    tol_level: torch.Tensor  # int64 [Hq]: 0 (the device path has no bound tolerance)


def outputs(c: Certified, done: Finished | None = None
            ) -> tuple[CertifyOutputs, Finished]:
    """The pass's :class:`~certkv.certify.segment.CertifyOutputs` over what the merge wrote,
    and the :class:`Finished` tensors in it that the fallback kernel fills in (read nothing of
    the rungs before it ran): ``done`` where given (a batch's, :func:`finished`), else new."""
    hq = c.res.shape[1]
    done = done or finished(1, hq, c.res.device, one=True)
    res, resi = c.res, c.resi
    return CertifyOutputs(res[0], res[1], res[2], res[3], resi[0], c.canary, done.rung, resi[1],
                          done.flags, res[4], res[5], (done.returned[0], done.returned[1]),
                          done.e_final), done


def finished(nseq: int, hq: int, dev: torch.device, one: bool = False) -> Finished:
    """:class:`Finished` tensors for ``nseq`` sequences (a leading sequence axis, or, with
    ``one``, none)."""
    lead = () if one else (nseq,)
    return Finished(torch.empty(*lead, hq, dtype=torch.int64, device=dev),
                    torch.empty(*lead, hq + 2, dtype=torch.bool, device=dev),
                    torch.empty(*lead, 2, hq, device=dev), torch.empty(*lead, hq, device=dev),
                    torch.empty(*lead, hq, dtype=torch.int64, device=dev))


class CertifyRequest(NamedTuple):
    """What the merge's epilogue needs besides Phase 2's own results: the certificate's
    inputs (:class:`~certkv.certify.segment.CertifyInputs`; Phase 2's fields are not read but
    ``canary_blocks``, which Phase 2 fills in), the step's scalars (:func:`scalars`) and
    weights, and the rungs' settings (``wanted``: 1 ranking check, 2 boundary check)."""

    x: CertifyInputs
    par: torch.Tensor
    weights: torch.Tensor
    certified: bool
    canary: bool
    least: float
    wanted: int
