"""The ranking and boundary checks (eq. 17-18) as numba loops, for one query head at a time:
what Phase 2's epilogue (:func:`certkv.kernels.numba_attend.attend`) runs after a head's block
masses. The same decisions as :func:`certkv.certify.checks.rank_checks` (a stable descending
sort with NaN first, the ``r``-th FP16 log-mass as the boundary's threshold).
"""

from __future__ import annotations

import numpy as np

from certkv.certify.fused_cpu import jit

_F32 = np.float32


@jit
def _before(a, i, b, j):
    """Whether entry ``(a, i)`` precedes ``(b, j)`` in a stable descending sort (NaN first)."""
    if a != a:
        return b == b or i < j
    if b != b:
        return False
    return a > b or (a == b and i < j)


@jit
def _top_r(x, members, k, idx, val):
    """The ``k`` first blocks of a stable descending sort of ``x [n]`` with non-members at
    ``-inf`` (:func:`certkv.certify.checks.top_r`) into ``idx, val [k]``; returns how many
    members exist."""
    n = x.shape[0]
    for j in range(k):
        best = -1
        for b in range(n):
            taken = False
            for i in range(j):
                taken = taken or idx[i] == b
            if taken:
                continue
            v = x[b] if members[b] else _F32(-np.inf)
            if best < 0 or _before(v, b, val[j], best):
                best, val[j] = b, v
        idx[j] = best
    count = 0
    for b in range(n):
        count += members[b]
    return count


@jit
def rank_checks(h, l8, l16, delta_b, promoted, quantized, r, ranking, boundary):
    """Eq. 17 (the top-``r`` promoted blocks agree under both log-masses) and eq. 18 (no INT8
    tail block's ``l8 + Delta_b`` exceeds the ``r``-th FP16 log-mass) for head ``h``
    (:func:`certkv.certify.checks.rank_checks`)."""
    n = l8.shape[1]
    k = min(r, n)
    idx8, idx16 = np.empty(k, np.int64), np.empty(k, np.int64)
    val8, val16 = np.empty(k, _F32), np.empty(k, _F32)
    count = _top_r(l8[h], promoted[h], k, idx8, val8)
    _top_r(l16[h], promoted[h], k, idx16, val16)
    ok = True
    for j in range(k):
        ok = ok and (idx8[j] == idx16[j] or j >= count)
    ranking[h] = ok
    threshold = val16[k - 1] if count >= r else _F32(-np.inf)
    ok = True
    for b in range(n):
        upper = l8[h, b] + delta_b[h, b] if quantized[b] and not promoted[h, b] \
            else _F32(-np.inf)
        ok = ok and upper <= threshold
    boundary[h] = ok
