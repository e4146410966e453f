"""The CPU backend's logit loops (certkv.kernels.numba_logits): the dot products of a group of
3 or 4 query heads, which read each key once for the group, are the one-head loop's sums bit
for bit (the same FP32 operations in the same order), so the smoke digests hold."""

from __future__ import annotations

import numpy as np
import pytest

import certkv.kernels.numba_logits as nl

F32 = np.float32


def _case(rng, group: int, d: int, bsz: int):
    """Adversarial operands: magnitudes from 1e-3 to 1e3 (cancellation, large sums), keys with
    zeros and a NaN-free spread, a slot bias with ``-inf`` on empty slots."""
    q = (rng.standard_normal((group, d)) * rng.choice([1e-3, 1.0, 1e3], size=(group, 1)))
    keys = rng.standard_normal((bsz, d)) * rng.choice([1e-2, 1.0, 30.0], size=(bsz, 1))
    keys[rng.random((bsz, d)) < 0.05] = 0.0
    bias = np.where(rng.random(bsz) < 0.2, -np.inf, 0.0)
    return q.astype(F32), keys.astype(F32), bias.astype(F32)


@pytest.mark.parametrize("group", [3, 4])
@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_a_group_s_dot_products_equal_one_head_at_a_time_bit_for_bit(group, d):
    rng = np.random.default_rng(group * 1000 + d)
    for _ in range(40):
        q, keys, bias = _case(rng, group, d, 16)
        together, alone = np.empty((group, 16), F32), np.empty((group, 16), F32)
        nl._dots(q, keys, bias, F32(0.125), together)
        nl._dots_any(q, keys, bias, F32(0.125), alone)
        assert np.array_equal(together.view(np.int32), alone.view(np.int32))


def test_other_groups_take_the_one_head_loop():
    """Groups of 1, 2 and 8 heads (and a block of 5 tokens) give the one-head loop's logits,
    each within FP32's rounding of the FP64 dot product."""
    rng = np.random.default_rng(7)
    for group in (1, 2, 8):
        q, keys, bias = _case(rng, group, 32, 5)
        got = np.empty((group, 5), F32)
        nl._dots(q, keys, bias, F32(0.5), got)
        alone = np.empty_like(got)
        nl._dots_any(q, keys, bias, F32(0.5), alone)
        assert np.array_equal(got.view(np.int32), alone.view(np.int32))
        exact = 0.5 * (q.astype(np.float64) @ keys.astype(np.float64).T) + bias
        scale = 0.5 * np.abs(q.astype(np.float64)) @ np.abs(keys.astype(np.float64)).T
        finite = np.isfinite(exact)
        assert np.array_equal(np.isfinite(got), finite)
        assert (np.abs(got[finite] - exact[finite]) <= 34 * 2.0**-24 * scale[finite] + 1e-30).all()
