"""The certificate's numbers as one fused loop nest on CPU tensors (issue 24), compiled by numba.

:func:`certkv.certify.step_certify.certify_step` states the certificate as about 260
small PyTorch operators on ``[Hq]`` and ``[Hq, n]`` tensors; on a CPU each costs microseconds
of dispatch for nanoseconds of arithmetic. :func:`certificate` evaluates the same mathematics
(eq. 15 with both caps in three lanes, the per-block TV bound in two, Cor. 4.2's E_val, and
E_arith's items 1-6 through :mod:`certkv.certify.arith`'s constants and linear form) head by
head and block by block in FP64, in one call. Every input is read as given (FP32 inputs
widened exactly to FP64), so each quantity is at least as accurate as the FP32 / FP64 PyTorch
evaluation the arithmetic bound allows for; the returned terms round to FP32 the same way.
``tests/certify/test_fused_cpu.py`` holds both evaluations to each other and the contract tests hold
this one to FP64 attention.

NaN and infinity follow PyTorch's rules (``minimum`` and ``amax`` propagate NaN, ``where``
picks), so a head whose bound is not finite here is one whose bound is not finite there.
"""

from __future__ import annotations

import math
import threading
import weakref
from collections.abc import Callable
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import torch

from certkv.certify import numba_cache
from certkv.certify.arith import (
    LOG_ULPS,
    ROUND_UP_ABS,
    ROUND_UP_REL,
    TINY,
    U32,
    ArithSpec,
    StepCoefficients,
    gamma,
    logit_rounding_form,
    magnitude_factor,
)

try:  # without numba the PyTorch operators run (same results, slower)
    import numba
    import numba.core.caching
except ImportError:
    numba = None

if numba is not None:  # a kernel's cache is stale once any certkv source changes
    numba_cache.install(numba)

AVAILABLE = numba is not None
prange = numba.prange if AVAILABLE else range  # a parallel loop in jit(parallel=True) kernels
_F64_TINY, _F64_MAX = float(np.finfo(np.float64).tiny), float(np.finfo(np.float64).max)


def jit(fn=None, **flags):
    """numba's ``njit`` (compiled once, cached beside the module; IEEE arithmetic unless
    ``flags`` say otherwise), or ``fn`` itself where numba is missing."""
    if fn is None:
        return lambda f: jit(f, **flags)
    return numba.njit(cache=True, nogil=True, **flags)(fn) if AVAILABLE else fn


_THREADS = threading.local()  # the count this thread last gave numba (numba's is per thread)


def use_threads(n: int) -> None:
    """Let numba's parallel loops use at most ``n`` threads (pass torch's own setting, which
    ``threads`` pins), never more than numba started; set only when it changes (a decode step
    asks before every loop nest, and the call costs a microsecond)."""
    if AVAILABLE and getattr(_THREADS, "n", None) != n:
        numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))
        _THREADS.n = n


@jit
def _nmin(a, b):
    """``torch.minimum`` on two floats: NaN if either is NaN."""
    if a != a or b != b:
        return math.nan
    return a if a < b else b


@jit
def _nmax(a, b):
    """``torch.maximum`` on two floats: NaN if either is NaN."""
    if a != a or b != b:
        return math.nan
    return a if a > b else b


@jit
def _lse(x, mask, row):
    """``torch.logsumexp`` of ``x[row, b]`` over the blocks ``b`` where ``mask[b]`` (-inf
    elsewhere): ``-inf`` for an empty set, ``+inf`` past FP64, NaN with a NaN input."""
    n = x.shape[1]
    top = -math.inf
    for b in range(n):
        if mask[b]:
            top = _nmax(top, np.float64(x[row, b]))
    shift = 0.0 if math.isinf(top) else top
    total = 0.0
    for b in range(n):
        if mask[b]:
            total += math.exp(np.float64(x[row, b]) - shift)
    return math.log(total) + shift


@jit
def _tv_block(n, rho, d, lam, spread):
    """:func:`~certkv.certify.bounds.block_tv_bound` over ``n`` blocks (FP64 arrays). A block
    read exactly (``D_b = +-0``: promoted, or the tail) adds nothing to the numerator (its
    ``min(rho_b D_b, ...)`` is 0 or NaN, never ``> 0``) and ``rho_b (e^{-D_b} - 1) = rho_b
    (-D_b)`` exactly to the denominator's sum, so it skips both ``expm1``: the same numbers
    with about half the transcendentals of a step that promotes half its blocks."""
    num, kept, top = 0.0, 0.0, -math.inf
    for b in range(n):
        db = d[b]
        top = _nmax(top, db)
        if db == 0.0:  # expm1(-(+-0)) is -(+-0)
            kept += rho[b] * -db
            continue
        dc = db if db != db else min(max(db, _F64_TINY), _F64_MAX)
        phi = math.expm1(dc) / dc
        per = _nmin(rho[b] * db, spread[b] * lam[b])
        if per > 0:
            num += phi * per
        kept += rho[b] * math.expm1(-db)
    den = _nmax(1.0 + kept, math.exp(-top))
    tv = num / (den if den != den else max(den, _F64_TINY))
    return 1.0 if tv != tv else min(tv, 1.0)


@jit
def _log_sigmoid(x):
    """``logsigmoid(x) = min(x, 0) - log1p(e^{-|x|})``."""
    return min(x, 0.0) - math.log1p(math.exp(-abs(x))) if x == x else x


@jit
def _key_bound(v, delta, delta_tail, log_alpha, exponent, cap_logit, tv_cap):
    """:func:`~certkv.certify.bounds.key_error_bound` for one head and lane."""
    log_tail = _nmin(exponent * delta + log_alpha, 0.0)
    log_tail = _nmin(log_tail, _log_sigmoid(cap_logit))
    x = 2.0 * delta_tail
    log_a3 = log_tail + (x + math.log(-math.expm1(-x)))
    if log_tail == -math.inf:
        log_a3 = log_tail
    tv = _nmin(math.tanh(delta_tail / 2.0), math.exp(_nmin(log_a3, 0.0)))
    return 2.0 * v * _nmin(tv, tv_cap)


@jit
def _widen(x, slack):
    """:func:`certkv.certify.arith._widen` on a float (``sign`` as ``torch.sign``)."""
    sign = 0.0 if x == 0 else (1.0 if x > 0 else -1.0)
    if x != x:
        sign = x
    return x * (1.0 + LOG_ULPS * U32 * sign) + slack


@jit
def _round_up(x):
    """:func:`certkv.certify.arith._round_up_fp32` of ``max(x, 0)`` (NaN stays NaN)."""
    if x == x:
        x = max(x, 0.0)
    return np.float32(x * (1.0 + ROUND_UP_REL) + ROUND_UP_ABS)


def lanes_scratch(hq: int, n: int) -> tuple:
    """:func:`_kernel`'s scratch, each head's rows of: FP64 lanes (rho, D, lam, spread as
    computed, then widened) ``[Hq, 8, n]``, its INT8 tail blocks ``[Hq, n]`` (bool) and the
    tail blocks' upper log-masses ``[Hq, 2, n]`` (FP64)."""
    return np.empty((hq, 8, n)), np.empty((hq, n), np.bool_), np.empty((hq, 2, n))


@jit(parallel=True)
def _kernel(blocks, per_head, per_kv, promoted, exact, value_kv, q, key_abs_max, eta_max_kv,
            out, par, weights, lanes_all):
    """Every head's terms (see :func:`certificate`), heads in parallel (each writes its own
    results): ``blocks [7, Hq, n]`` stacks ``l8, l16, rho, spread, log_p, delta_b,
    delta_chan``; ``per_head [4, Hq]`` ``delta, v_max, v_rad, q_norm``; ``per_kv [3, Hkv, n]``
    ``eta, value_spec, key_spec``; ``par, weights``: :func:`_params`; ``lanes_all``:
    :func:`lanes_scratch`."""
    l8, l16, rho, spread, log_p, delta_b, delta_chan = blocks
    delta, v_max, v_rad, q_norm = per_head
    eta, value_spec, key_spec = per_kv
    hq, n = l8.shape
    group = hq // eta.shape[0]
    scaling, exponent, eps_a, eps_b, eps_c, mag_factor, kappa0, rho_rel, spread_rel, g = par
    f32 = np.float32
    res_f = np.empty((6, hq), dtype=np.float32)  # e_key, e_val, e_arith, tail, paper key, val
    res_i = np.empty((2, hq), dtype=np.int64)  # k_star, value_blocks
    all_lanes, all_tails, all_up = lanes_all  # each head's scratch rows
    for h in prange(hq):
        lanes = all_lanes[h]  # rho, D, lam, spread as computed, then widened
        tail = all_tails[h]  # the head's INT8 tail blocks
        up = all_up[h]  # upper log-masses of the tail blocks: tight, eq. 8's Delta_b
        kv = h // group  # query head h reads kv head h // G
        for b in range(n):
            tail[b] = not (promoted[h, b] or exact[b])
        # log-sum-exps over blocks: U_T (tight and eq. 8's Delta_b), Z_F, alpha_hat
        for b in range(n):
            up[0, b] = np.float64(l8[h, b]) + delta_b[h, b]
            up[1, b] = np.float64(l8[h, b]) + delta_chan[h, b]
        log_u, log_u_chan = _lse(up, tail, 0), _lse(up, tail, 1)
        log_z, log_alpha = _lse(l16, promoted[h], h), _lse(log_p, tail, h)
        cap = log_u if log_u == -math.inf else log_u - log_z
        cap_chan = log_u_chan if log_u_chan == -math.inf else log_u_chan - log_z
        d_t, d_t_chan, d_chan_max = -math.inf, -math.inf, -math.inf
        for b in range(n):
            d_t = _nmax(d_t, delta_b[h, b] if tail[b] else 0.0)
            d_t_chan = _nmax(d_t_chan, delta_chan[h, b] if tail[b] else 0.0)
            d_chan_max = _nmax(d_chan_max, np.float64(delta_chan[h, b]))
        # item 1: S, eps, kappa
        mag = 0.0
        for c in range(q.shape[1]):
            mag += abs(q[h, c]) * np.float64(key_abs_max[kv, c])
        mag *= mag_factor
        dh = np.float64(delta[h])
        eps = eps_a * (mag + dh) + (eps_b * dh + eps_c)
        kappa = kappa0 + LOG_ULPS * U32 * (mag + dh)
        # the per-block TV bound as returned and at the widened inputs (item 2)
        grow = math.exp(2.0 * eps)
        lam_h = scaling * np.float64(q_norm[h])
        for b in range(n):
            lam = lam_h * key_spec[kv, b]
            lanes[0, b], lanes[2, b], lanes[3, b] = rho[h, b], lam, spread[h, b]
            lanes[1, b] = delta_b[h, b] if tail[b] else 0.0
            lanes[4, b] = TINY * grow + rho[h, b] * ((1.0 + rho_rel) * grow)
            lanes[5, b] = delta_b[h, b] + eps if tail[b] else 0.0
            lanes[6, b] = lam * (1.0 + 2.0 * g)
            lanes[7, b] = TINY * grow + spread[h, b] * ((1.0 + spread_rel) * grow)
        tv_block = _tv_block(n, lanes[0], lanes[1], lanes[2], lanes[3])
        tv_block_plus = _tv_block(n, lanes[4], lanes[5], lanes[6], lanes[7])
        # E_key (eq. 15 with both caps): returned, the paper's form, widened (item 2)
        vm, vr = np.float64(v_max[h]), np.float64(v_rad[h])
        e_key = f32(_key_bound(vr, dh, d_t, log_alpha, exponent, cap, tv_block))
        paper_key = f32(_key_bound(vm, d_chan_max, d_t_chan, log_alpha, exponent, cap_chan,
                                   math.inf))
        tv_plus = _key_bound(0.5, dh + eps, d_t + eps, _widen(log_alpha, kappa), exponent,
                             _widen(cap, 2.0 * eps + 2.0 * kappa), tv_block_plus)
        # E_val (Cor. 4.2 per block, tight and the paper's) over the blocks read quantized
        e_val, paper_val, sigma_max, n_val = 0.0, 0.0, -math.inf, 0
        for b in range(n):
            fp16 = value_kv[kv, b]
            if fp16:
                n_val += 1
            eta_b = 0.0 if fp16 else np.float64(eta[kv, b])
            sigma = 0.0 if fp16 else np.float64(value_spec[kv, b])
            e_val += _nmin(rho[h, b] * eta_b, spread[h, b] * sigma)
            paper_val += rho[h, b] * eta_b
            sigma_max = _nmax(sigma_max, sigma)
        e_val = f32(e_val)
        # E_arith (items 3, 4, 6): the linear form of composition_weights
        out_sq = 0.0
        for c in range(out.shape[1]):
            out_sq += np.float64(out[h, c]) ** 2
        key_plus = 2.0 * _nmin(vr, vm) * (tv_plus + math.tanh(eps / 2.0))
        parts = (key_plus, np.float64(e_val), np.float64(eta_max_kv[kv]), sigma_max, vm,
                 math.sqrt(out_sq), 1.0)
        total = 0.0
        for i in range(7):
            total += weights[i] * parts[i]
        res_f[0, h], res_f[1, h], res_f[2, h] = e_key, e_val, _round_up(total - e_key)
        res_f[3, h], res_f[4, h], res_f[5, h] = f32(math.exp(log_alpha)), paper_key, paper_val
        k_star = 0
        for b in range(n):
            if promoted[h, b] and not exact[b]:
                k_star += 1
        res_i[0, h], res_i[1, h] = k_star, n_val
    return res_f, res_i


@lru_cache(maxsize=64)
def _params(spec: ArithSpec, coef: StepCoefficients, exponent: float) -> tuple:
    """The step's scalars in the order :func:`_kernel` unpacks them, and the linear form's
    weights (memoised: ``coef`` is :func:`~certkv.certify.arith.step_coefficients`', shared by
    every layer of a step)."""
    d = spec.head_dim
    eps_a, eps_b, eps_c = logit_rounding_form(spec.rounding.logit_gamma(d), spec.scaling, d)
    return np.array([spec.scaling, exponent, eps_a, eps_b, eps_c,
                     magnitude_factor(spec.scaling, d), coef.kappa, coef.rho_rel,
                     coef.spread_rel, gamma(d + 8)], dtype=np.float64), as_array(coef.weights)


def as_array(x: torch.Tensor) -> np.ndarray:
    """A contiguous NumPy view (a copy only for a strided tensor)."""
    return np.ascontiguousarray(x.numpy())


_KEPT: dict[tuple[int, str], tuple] = {}  # (id(tensor), kind) -> (weak reference, made)


def kept(x: torch.Tensor, kind: str, make: Callable[[torch.Tensor], tuple]):
    """``make(x) -> (made, view)``, memoised per live tensor object and ``kind`` where
    ``view`` says ``made`` views ``x``'s memory: NumPy views of the tensors a store keeps
    between steps are made once (writes into them show through; the entry goes with the
    tensor), copies every call. ``made`` must not reference ``x`` itself (view a
    ``x.detach()``), or ``x`` would live as long as its entry."""
    key = (id(x), kind)
    hit = _KEPT.get(key)
    if hit is not None and hit[0]() is x:
        return hit[1]
    made, view = make(x)
    if view:
        _KEPT[key] = (weakref.ref(x, lambda _: _KEPT.pop(key, None)), made)
    return made


def kept_array(x: torch.Tensor) -> np.ndarray:
    """:func:`as_array` of a tensor a store keeps between steps, made once per tensor where it
    is a view (:func:`kept`)."""
    return kept(x, "array", lambda t: (as_array(t.detach()), t.is_contiguous()))


def kept_bits(x: torch.Tensor) -> np.ndarray:
    """The bits (int16) of an FP16 tensor a store keeps between steps, as a NumPy view made
    once per tensor (:func:`kept`)."""
    return kept(x, "bits", lambda t: (t.detach().view(torch.int16).numpy(), True))


class RungInputs(NamedTuple):
    """What the rungs read besides the certificate's terms (:func:`rungs`)."""

    ladder: object
    certified: bool
    expanded: torch.Tensor  # [Hq] rung 1
    ranking: torch.Tensor  # [Hq] eq. 17
    boundary: torch.Tensor  # [Hq] eq. 18
    canary_blocks: torch.Tensor  # [Hkv, G, n]
    kv_bad: torch.Tensor | bool  # non-finite appended K/V


def certificate(spec: ArithSpec, coef: StepCoefficients, exponent: float, x,
                rung_inputs: RungInputs):
    """The certificate's per-head terms of a quantized step on CPU tensors, then its rungs, in
    two calls.

    ``x`` holds the named inputs (a :class:`~certkv.certify.segment.CertifyInputs`; the fields
    below are those read).
    Args (CPU tensors; shapes as :func:`~certkv.certify.step_certify.certify_step`): ``[Hq, n]``
    block tensors ``l8, l16, rho, spread, log_p, delta_b`` (tightened), ``delta_chan`` (eq. 8),
    ``promoted``; ``[Hq]`` tensors ``delta, v_max, v_rad`` (``min(R, V_max)``); ``q_norm [Hkv,
    G]``; ``exact [n]``; ``value_kv, eta, value_spec, key_spec [Hkv, n]``; ``q [Hq, d]`` any
    float dtype (query head ``h`` reads kv head ``h // G``); ``key_abs_max [Hkv, d]``;
    ``eta_max_kv [Hkv]``; ``out [Hq, d]`` the FP32 output. ``exponent``: eq. 14's mass
    inflation.
    Returns: FP32 ``e_key, e_val, e_arith, tail_mass, paper_key, paper_val``, int64
    ``k_star, value_blocks``, each ``[Hq]``, then :func:`rungs`' four results.
    """
    blocks = torch.stack([x.l8, x.l16, x.rho, x.spread, x.log_p, x.delta_b, x.delta_chan])
    per_head = torch.stack([x.delta, x.v_max, x.v_rad, x.q_norm.reshape(-1)])
    per_kv = torch.stack([x.eta, x.value_spec, x.key_spec])
    q64, out32 = as_array(x.q.double()), as_array(x.out)
    use_threads(torch.get_num_threads())
    res_f, res_i = _kernel(*(as_array(t) for t in (
        blocks, per_head, per_kv, x.promoted, x.exact, x.value_kv)), q64,
        as_array(x.key_abs_max), as_array(x.eta_max_kv), out32, *_params(spec, coef, exponent),
        lanes_scratch(blocks.shape[1], blocks.shape[2]))
    ruled = _rung_arrays(*res_f[:3], res_i[1], out32, q64, x.q.dtype, rung_inputs)
    f, i = torch.from_numpy(res_f), torch.from_numpy(res_i)
    return (*f.unbind(), *i.unbind(), *ruled)


#: ``|x|`` from which a cast of FP32 ``x`` to the query's dtype overflows (round to nearest:
#: half an ulp above the largest finite number; FP32 / FP64 queries keep every finite output).
CAST_LIMIT = {torch.float16: 65520.0, torch.bfloat16: 2.0**128 - 2.0**119}


@jit
def _rungs(e_key, e_val, e_arith, value_blocks, out, q, expanded, ranking, boundary,
           canary_blocks, kv_bad, limit, certified, use_canary, least, canary, rung, flags,
           returned):
    """:func:`~certkv.certify.step_certify.rungs` and
    :func:`~certkv.certify.step_certify.returned` in one pass (outputs ``canary, rung [Hq]``,
    ``flags [Hq + 2]``, ``returned [2, Hq]``)."""
    hq = out.shape[0]
    q_bad = False
    for x in q.ravel():
        q_bad = q_bad or not abs(x) < np.inf
    all_canary, dense = True, 0
    for h in range(hq):
        top = np.float32(0.0)
        for x in out[h]:
            top = abs(x) if (abs(x) > top or x != x) else top
        bound = (e_key[h] + e_val[h]) + e_arith[h]
        finite = top < limit and bound < np.inf
        r = max(1 if expanded[h] else 0, 2 if value_blocks[h] > 0 else 0)
        if not (ranking[h] and boundary[h] and finite if certified else finite):
            r = 3
        ok = True
        if certified and use_canary:
            for b in range(canary_blocks.shape[1]):
                ok = ok and not canary_blocks[h, b]
        canary[h] = ok
        all_canary = all_canary and ok
        dense += r >= 3
        rung[h] = r
    for h in range(hq):
        if certified and (not all_canary or dense >= least):
            rung[h] = 4
        flags[h] = rung[h] >= 3
        returned[0, h] = e_key[h] if rung[h] < 3 else np.float32(0.0)
        returned[1, h] = e_val[h] if rung[h] < 3 else np.float32(0.0)
    flags[hq], flags[hq + 1] = q_bad, kv_bad


def rungs(bounds: tuple, value_blocks, out, q, inputs: RungInputs):
    """The canary ``[Hq]``, each head's rung ``[Hq]``, the flags ``[Hq + 2]`` and the returned
    E_key, E_val ``[Hq]`` (0 on rungs 3-4) of :func:`~certkv.certify.step_certify.rungs` in one
    call on CPU tensors (``bounds``: E_key, E_val, E_arith ``[Hq]``; ``inputs.canary_blocks
    [Hkv, G, n]``, ``inputs.kv_bad`` 0-d; the rest as there)."""
    return _rung_arrays(*(as_array(x) for x in (*bounds, value_blocks, out)),
                        as_array(q.double()), q.dtype, inputs)


def _rung_arrays(e_key, e_val, e_arith, value_blocks, out, q64, q_dtype, inputs: RungInputs):
    """:func:`_rungs` on NumPy terms (``q64``: the query in FP64, ``q_dtype`` its own)."""
    hq = out.shape[0]
    canary, rung = np.empty(hq, np.bool_), np.empty(hq, np.int64)
    flags, returned = np.empty(hq + 2, np.bool_), np.empty((2, hq), np.float32)
    ladder = inputs.ladder
    _rungs(e_key, e_val, e_arith, value_blocks, out, q64,
           *(as_array(x) for x in (inputs.expanded, inputs.ranking, inputs.boundary,
                                   inputs.canary_blocks.reshape(hq, -1))),
           bool(inputs.kv_bad), CAST_LIMIT.get(q_dtype, math.inf), inputs.certified,
           ladder.canary, max(1.0, ladder.layer_dense_fraction * hq), canary, rung, flags,
           returned)
    returned = torch.from_numpy(returned)
    return (torch.from_numpy(canary), torch.from_numpy(rung), torch.from_numpy(flags),
            tuple(returned.unbind()))
