"""The block softmax's numba primitives (certkv.kernels.numba_softmax): ``2^x`` within 1 u of
FP64, and a row of blocks' softmax state as the reference's."""

from __future__ import annotations

import numpy as np
import torch

import certkv.kernels.numba_softmax as ns
from certkv.kernels.reference import block_softmax

F32_TINY = float(np.finfo(np.float32).tiny)


def test_exp2_is_within_one_ulp_of_fp64():
    """The vectorised ``2^x`` is within 1 u (2^-24 relative) of FP64 ``exp2`` where the result
    is a normal FP32 number and within 2^-150 below; NaN, +-inf and overflow as IEEE."""
    x = np.concatenate([np.linspace(-160.0, 130.0, 400_001), -np.logspace(-30, 2, 2001),
                        [0.0, -0.0, -149.0, -126.0, -150.5, 127.9999, 128.0, 1e30, -1e30]])
    x = x.astype(np.float32)
    got = np.empty_like(x)
    ns.exp2(x, got, np.empty(x.size), np.empty(x.size))
    with np.errstate(over="ignore"):
        want = np.exp2(x.astype(np.float64))
    normal = (want >= F32_TINY) & (want < np.finfo(np.float32).max)
    rel = np.abs(got[normal].astype(np.float64) - want[normal]) / want[normal]
    assert rel.max() <= 2.0**-24 * (1 + 1e-6)
    small = want < F32_TINY
    assert np.abs(got[small].astype(np.float64) - want[small]).max() <= 2.0**-150
    assert np.isinf(got[want > np.finfo(np.float32).max]).all()
    special = np.array([np.nan, -np.inf, np.inf], np.float32)
    out = np.empty_like(special)
    ns.exp2(special, out, np.empty(3), np.empty(3))
    assert np.isnan(out[0]) and out[1] == 0.0 and out[2] == np.inf


def test_block_softmax_agrees_with_the_reference():
    """:func:`row_state` against :func:`block_softmax`, empty and partial blocks included."""
    s = torch.randn(5, 8) * 40
    s[1] = float("-inf")  # an empty block
    s[3, 4:] = float("-inf")  # a partial one
    w = np.empty((5, 8), np.float32)
    m, total, total2 = (np.empty(5, np.float32) for _ in range(3))
    ns.row_state(s.numpy(), w, m, total, total2, np.empty(40), np.empty(40))
    ref = block_softmax(s)
    torch.testing.assert_close(torch.from_numpy(w), ref.w, rtol=2e-6, atol=1e-38)
    torch.testing.assert_close(torch.from_numpy(m), ref.m)
    for got, want in ((total, ref.l), (total2, ref.l2)):
        torch.testing.assert_close(torch.from_numpy(got), want, rtol=1e-6, atol=0.0)
    assert (w[1] == 0).all() and m[1] == -np.inf
