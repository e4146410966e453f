"""Selection (paper 3.3), rung 1 and value promotion (rung 2) as one fused loop nest on CPU
tensors (issue 24), compiled by numba.

:func:`certkv.certify.step_select.select_step` states them as about 75 small PyTorch
operators on ``[Hq, n]`` tensors; on a CPU each costs microseconds of dispatch. :func:`select`
computes the same quantities head by head for the default policy: ``AdaptiveTopK`` ranking by
mass without the KV-group union, the ladder's tight tail mass without ``e_key_tol``, exploration
or a bound tolerance, and ``LocalThreshold`` values (either contribution).
:func:`covers` says whether a step's components are that policy; any other runs the operators.

Sums and log-sum-exps are taken in FP64 and rounded once to FP32, so each quantity is at least
as accurate as the PyTorch operators' FP32 evaluation (whose rounding the certificate allows
for, ``arith.LOG_ULPS``); decisions (``K*``, rung 1, value promotion) can differ from theirs
only where a threshold falls within that rounding, and every choice is certified alike.
NaN follows PyTorch's rules (``minimum`` and ``amax`` propagate it, sorting puts it first, a
comparison with it is false). ``tests/certify/test_fused_select.py`` holds both to each other.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from certkv.certify.fused_cpu import _lse, _nmin, as_array, jit, prange, use_threads
from certkv.certify.segment import SelectInputs, Selection
from certkv.certify.select import AdaptiveTopK
from certkv.certify.step_select import forced_values
from certkv.certify.values import LocalThreshold

_F32 = np.float32


def covers(selector, ladder, value_policy, draw, boost) -> bool:
    """Whether :func:`select` computes this step's selection (the default policy, nothing
    boosted; blocks forced by targeted page-in join it, :func:`force_blocks`)."""
    return (selector.fuses_on_cpu() and value_policy.fuses_on_cpu()
            and ladder.tail_mass == "tight" and ladder.e_key_tol is None
            and draw is None and boost is None)


@jit
def _descending(key, scratch):
    """A stable descending argsort of ``key [n]`` with NaN first (``torch.sort(descending=True,
    stable=True)`` on keys below ``+inf``, NaN taken as ``+inf``): a stable ascending sort of
    ``-key`` (``-0`` as ``+0``) as a least-significant-digit radix sort of its FP32 bits made
    monotone (sign bit flipped, every bit of a negative value flipped), one byte per pass,
    skipping a byte every key shares. Equal keys have equal bits and each pass is stable, so
    the order is exactly a stable comparison sort's (``np.argsort(kind="mergesort")``), in
    ``O(n)`` instead of ``O(n log n)`` (a selection at 8K sorts 513 blocks per head).
    ``scratch``: FP32 ``[n]``, int64 ``[2, n]`` and int64 ``[256]``. Returns ``order [n]``
    (a row of the int64 scratch)."""
    neg, orders, counts = scratch
    n = key.shape[0]
    for b in range(n):
        x = key[b]
        neg[b] = -np.inf if x != x else -x + _F32(0.0)  # -0 + 0 = +0
    bits = neg.view(np.uint32)
    for b in range(n):
        bits[b] = ~bits[b] if bits[b] >> np.uint32(31) else bits[b] | np.uint32(1 << 31)
    order, spare = orders[0], orders[1]
    for b in range(n):
        order[b] = b
    for shift in range(0, 32, 8):
        counts[:] = 0
        for b in range(n):
            counts[(bits[b] >> np.uint32(shift)) & np.uint32(255)] += 1
        if counts.max() == n:  # every key has this byte
            continue
        start = 0
        for digit in range(256):
            start, counts[digit] = start + counts[digit], start
        for j in range(n):
            digit = (bits[order[j]] >> np.uint32(shift)) & np.uint32(255)
            spare[counts[digit]] = order[j]
            counts[digit] += 1
        order, spare = spare, order
    return order


@jit
def _coverage_k(p, quantized, order, n_q, tau_cov):
    """Smallest ``K`` with ``C_K >= tau_cov`` (:func:`certkv.certify.select.coverage_k`)."""
    total, covered = 0.0, 0.0
    for b in range(p.shape[0]):
        total += p[b]
        if not quantized[b]:
            covered += p[b]
    target = _F32(tau_cov) * _F32(total)
    k = 0
    for j in range(n_q):
        if _F32(covered) < target:
            k += 1
        covered += p[order[j]]
    return k


@jit
def _expanded_k(k, factor, integral, cap):
    """Rung 1: ``min(max(ceil(factor K*), K* + 1), cap)``, never below ``K*``."""
    scaled = k * int(factor) if integral else math.ceil(_F32(k) * _F32(factor))
    return max(min(max(scaled, k + 1), cap), k)


@jit
def _head(h, kv, l8, delta_chan, log_spread, q, quantized, eta, value_spec, key_err, params,
          n_q, out_f, out_b, q_norm, expanded, scratch):
    """One query head: ``log_p``, tightened ``Delta_b``, the key set (``K*`` by coverage,
    rung 1 on the tight tail mass) and the value blocks it asks for. ``scratch``: the
    head's rows of :func:`select_scratch`."""
    scaling, tau_cov, k_min, k_cap, expand, factor, cap, v_tol, tight = params
    n = l8.shape[1]
    f32, sort, rank, flags = scratch
    log_p, delta_b, p, key = out_f[0, h], out_f[1, h], f32[0], f32[1]
    promoted, value = out_b[0, h], out_b[1, h]
    every, tail = flags[0], flags[1]
    every[:] = True
    lse = _lse(l8, every, h)
    acc = 0.0
    for c in range(q.shape[1]):
        acc += np.float64(q[h, c]) * np.float64(q[h, c])
    qn = _F32(math.sqrt(acc))
    q_norm[h] = qn
    delta = _F32(-np.inf)
    for b in range(n):
        log_p[b] = _F32(np.float64(l8[h, b]) - lse)
        p[b] = np.exp(log_p[b])
        delta_b[b] = _nmin(delta_chan[h, b], _F32(scaling) * qn * key_err[kv, b])
        delta = delta_b[b] if (delta_b[b] > delta or delta_b[b] != delta_b[b]) else delta
    out_f[2, h, 0] = delta
    for b in range(n):
        key[b] = p[b] if quantized[b] else _F32(-1.0)
    order = _descending(key, sort)
    for j in range(n):
        rank[order[j]] = j
    k = min(max(_coverage_k(p, quantized, order, n_q, tau_cov), k_min), k_cap)
    # tail: left on INT8 keys, quantized, of rank K* or more
    delta_f = _F32(0.0)
    for b in range(n):
        tail[b] = quantized[b] and rank[b] >= k
        d = _F32(0.0) if tail[b] else delta_b[b]
        delta_f = d if (d > delta_f or d != d) else delta_f
    log_bound = np.float64(delta_f) + _lse(out_f[0], tail, h)  # min(1, e^{Delta_F} alpha)
    log_bound = log_bound if (log_bound != log_bound or log_bound < 0.0) else 0.0
    k_new = k
    if expand and math.exp(log_bound) > 1.0 - tau_cov:
        k_new = _expanded_k(k, factor, factor == int(factor), cap)
    expanded[h] = k_new > k
    for b in range(n):
        promoted[b] = not quantized[b] or rank[b] < k_new
        contribution = p[b] * eta[kv, b]
        value[b] = contribution > _F32(v_tol) and eta[kv, b] > 0
        if tight and value[b]:  # the minimum can only keep it below v_tol (or make it NaN)
            spread = np.exp(log_spread[h, b] - (l8[h, b] - log_p[b]))
            contribution = _nmin(contribution, spread * value_spec[kv, b])
            value[b] = contribution > _F32(v_tol)


def select_scratch(hq: int, n: int) -> tuple:
    """:func:`_kernel`'s scratch, each head's rows of: FP32 ``[2, n]`` (``p``, the sort keys),
    int64 ranks ``[n]``, bool ``[2, n]`` (every block, the tail) and :func:`_descending`'s
    FP32 ``[n]``, int64 ``[2, n]`` and ``[256]``."""
    return (np.empty((hq, 2, n), _F32), np.empty((hq, n), np.int64),
            np.empty((hq, 2, n), np.bool_), np.empty((hq, n), _F32),
            np.empty((hq, 2, n), np.int64), np.empty((hq, 256), np.int64))


@jit(parallel=True)
def _kernel(l8, delta_chan, log_spread, q, quantized, eta, value_spec, key_err, v_max, v_rad,
            params, n_q, group, out_f, out_b, q_norm, expanded, plan, radii, exact, work):
    """:func:`_head` for every query head in parallel (head ``h`` reads kv head ``h //
    group``; each writes its own rows), then per kv head the page-in ``plan [2, Hkv, n]``
    (FP16 keys any of its heads promoted among the quantized blocks, FP16 values any asked
    for), each head's ``radii [2, Hq]`` (``V_max``, ``min(R, V_max)``) and ``exact [n]``.
    ``work``: :func:`select_scratch` (every element a head reads it writes first)."""
    hq, n = l8.shape
    f32, rank, flags, neg, orders, counts = work
    for h in prange(hq):
        _head(h, h // group, l8, delta_chan, log_spread, q, quantized, eta, value_spec, key_err,
              params, n_q, out_f, out_b, q_norm, expanded,
              (f32[h], (neg[h], orders[h], counts[h]), rank[h], flags[h]))
        kv = h // group
        radii[0, h], radii[1, h] = v_max[kv], _nmin(v_rad[kv], v_max[kv])
    for kv in range(hq // group):
        for b in range(n):
            keys, values = False, False
            for h in range(kv * group, (kv + 1) * group):
                keys = keys or out_b[0, h, b]
                values = values or out_b[1, h, b]
            plan[0, kv, b], plan[1, kv, b] = keys and quantized[b], values
    for b in range(n):
        exact[b] = not quantized[b]


def params(selector: AdaptiveTopK, ladder, value_policy: LocalThreshold, scaling: float,
           n_q: int) -> tuple:
    """:func:`_head`'s scalars for a step over ``n_q`` quantized blocks."""
    return (float(scaling), float(selector.tau_cov), int(selector.k_min),
            int(min(selector.k_max, n_q)), bool(ladder.expand), float(ladder.expand_factor),
            int(ladder.key_cap(selector.k_max, n_q)), float(value_policy.v_tol),
            value_policy.contribution == "tight")


def select(selector: AdaptiveTopK, ladder, value_policy: LocalThreshold,
           x: SelectInputs) -> Selection:
    """:func:`certkv.certify.step_select.select_step`'s :class:`~certkv.certify.segment.Selection`
    for the default policy (:func:`covers`: no exploration ``draw``, no ``boost``) in one call
    on the CPU tensors of ``x``."""
    qg, l8_kv, delta_kv, log_spread_kv = x.qg, x.l8_kv, x.delta_kv, x.log_spread_kv
    quantized, n_q, scaling = x.quantized, x.n_q, x.scaling
    hkv, group, n = l8_kv.shape
    hq = hkv * group
    out_f = np.empty((3, hq, n), _F32)  # log_p, delta_b, delta (in [2, :, 0])
    out_b = np.empty((2, hq, n), np.bool_)  # promoted, values wanted
    q_norm, expanded = np.empty(hq, _F32), np.empty(hq, np.bool_)
    plan, radii, exact = np.empty((2, hkv, n), np.bool_), np.empty((2, hq), _F32), \
        np.empty(n, np.bool_)
    delta_chan = delta_kv.reshape(hq, n)
    use_threads(torch.get_num_threads())
    _kernel(*(as_array(t) for t in (
        l8_kv.reshape(hq, n), delta_chan, log_spread_kv.reshape(hq, n),
        qg.reshape(hq, -1).float(), quantized, x.eta, x.value_spec, x.key_err, x.v_max_kv,
        x.v_rad_kv)),
        params(selector, ladder, value_policy, scaling, n_q), int(n_q), group, out_f, out_b,
        q_norm, expanded, plan, radii, exact, select_scratch(hq, n))
    out_f, out_b, plan, radii = (torch.from_numpy(t) for t in (out_f, out_b, plan, radii))
    promoted = out_b[0]
    if x.force is not None:
        promoted, plan = force_blocks(promoted, plan, x.force, quantized, x.eta)
    return Selection(out_f[0], out_f[1], out_f[2, :, 0], delta_chan, radii[0], radii[1],
                     torch.from_numpy(q_norm).view(hkv, group), promoted,
                     torch.from_numpy(expanded), plan[1], plan, torch.from_numpy(exact))


def force_blocks(promoted: torch.Tensor, plan: torch.Tensor, force: torch.Tensor,
                 quantized: torch.Tensor, eta: torch.Tensor):
    """The key set ``[Hq, n]`` and page-in ``plan [2, Hkv, n]`` with the blocks targeted page-in
    reads whole (``force [Hq, n]``: FP16 keys, and FP16 values where lossy), as
    :func:`~certkv.certify.step_select.select_step` adds them: after rung 1, and without moving
    the default value policy's promotions (its contributions do not read the key set)."""
    hkv, n = eta.shape
    promoted = promoted | force
    keys = promoted.view(hkv, -1, n).any(dim=1) & quantized
    return promoted, torch.stack([keys, plan[1] | forced_values(force, eta)])
