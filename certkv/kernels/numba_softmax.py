"""The block softmax's primitives for the CPU backend's loop nests (numba): a block's max as
PyTorch takes it (NaN propagates), ``2^x`` vectorised within 1 u, a block's weight sums, and a
row of blocks' softmax state; shared by Phase 1 (:mod:`certkv.kernels.numba_backend`) and Phase
2 (:mod:`certkv.kernels.numba_attend`)."""

from __future__ import annotations

import math

import numpy as np

from certkv.certify.fused_cpu import jit
from certkv.kernels.reference import LOG2E

_F32 = np.float32
_LOG2E = _F32(LOG2E)
_F32_MIN = _F32(np.finfo(np.float32).min)


@jit
def amax(x):
    """``x.amax()`` of a 1-D FP32 array as PyTorch computes it: NaN if any element is."""
    m = _F32(-np.inf)
    for v in x:
        m = v if (v > m or v != v) else m  # NaN, once met, stays (v > NaN is false)
    return m


_EXP2_TAYLOR = tuple(math.log(2.0) ** k / math.factorial(k) for k in range(12))
_MAGIC = float(2**52)  # 2^52 + k holds the integer k in its low mantissa bits
_MAGIC_BITS = 0x4330000000000000  # the bits of 2^52


@jit
def exp2(x, out, frac, scale):
    """``out [m] = 2^x`` for FP32 ``x [m]`` (``out`` may be ``x``), in loops that vectorize;
    ``frac, scale [>= m]`` FP64 scratch.

    ``x = k + f`` with ``k`` an integer and ``|f| <= 1/2`` (clamped to ``|x| <= 200``: FP32 results
    there are 0 or inf either way); ``2^f`` from its Taylor series to degree 11 in FP64 (relative
    error below 1e-11), ``2^k`` built from its exponent bits, and one rounding to FP32: within 1 u
    of ``2^x`` for normal results, within 2^-150 below them (arith's ``EXP_ULPS = 8`` and ``TINY``
    allow more). NaN stays NaN, ``-inf`` gives 0. ``tests/kernels/test_numba_backend.py`` checks it
    against FP64 ``exp2``."""
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = _EXP2_TAYLOR
    m = x.shape[0]
    for t in range(m):
        xd = np.float64(x[t])
        xc = xd if xd > -200.0 else -200.0
        xc = xc if xc < 200.0 else 200.0
        k = np.floor(xc + 0.5)
        f = xc - k
        p = ((((c11 * f + c10) * f + c9) * f + c8) * f + c7) * f + c6
        frac[t] = (((((p * f + c5) * f + c4) * f + c3) * f + c2) * f + c1) * f + c0
        scale[t] = k + (1023.0 + _MAGIC)
    bits = scale.view(np.int64)
    for t in range(m):
        bits[t] = (bits[t] - _MAGIC_BITS) << 52
    for t in range(m):
        r = _F32(frac[t] * scale[t])
        out[t] = r if x[t] == x[t] else x[t]


@jit(fastmath={"reassoc", "contract"})
def sums(w):
    """``(sum w, sum w^2)`` of FP32 weights in any order (``B - 1`` additions each, as the
    reference's ``sum`` allows)."""
    acc, acc2 = _F32(0.0), _F32(0.0)
    for x in w:
        acc += x
        acc2 += x * x
    return acc, acc2


@jit
def shifted(s, out):
    """One block's logits ``s [B]`` shifted for its softmax: ``out [B] = (s - max(m_b, FP32
    min)) log2 e``, the exponents of its weights; returns its max ``m_b`` (NaN if any logit is
    NaN)."""
    mb = amax(s)
    shift = mb if (mb != mb or mb > _F32_MIN) else _F32_MIN
    for t in range(s.shape[0]):
        out[t] = (s[t] - shift) * _LOG2E
    return mb


@jit
def row_state(s, w, m, total, total2, frac, scale):
    """The softmax state of one head's blocks from their logits ``s [n, B]`` (``-inf`` on empty
    slots): each block's max ``m [n]``, the weights ``w [n, B] = 2^((s - max(m_b, FP32 min))
    log2 e)`` (C-contiguous), their sums ``total`` and sums of squares ``total2 [n]``
    (:func:`certkv.kernels.reference.block_softmax`; the exponentials in one vectorised pass
    over the row, :func:`exp2` with scratch ``frac, scale [n B]``)."""
    n, bsz = s.shape
    for b in range(n):
        m[b] = shifted(s[b], w[b])
    flat = w.reshape(n * bsz)
    exp2(flat, flat, frac, scale)
    for b in range(n):
        total[b], total2[b] = sums(w[b])
