"""Phase 2's value loop (certkv.kernels.numba_attend): a block's products for a group of three
query heads, updated in one pass over its value rows, are the one-head-at-a-time products bit
for bit (each element the same expression), so the smoke digests hold."""

from __future__ import annotations

import numpy as np
import pytest

import certkv.kernels.numba_attend as na

F32 = np.float32


def _one_head_at_a_time(wb, block, o):
    """The generic loop of :func:`na._block_products`, one head per call."""
    for g in range(o.shape[0]):
        row = o[g : g + 1]
        na._block_products(wb[g : g + 1], block, row)


@pytest.mark.parametrize("d", [16, 64, 128])
def test_three_heads_products_equal_one_head_at_a_time_bit_for_bit(d):
    rng = np.random.default_rng(d)
    for _ in range(40):
        wb = (rng.random((3, 16)) * rng.choice([1e-30, 1e-3, 1.0], size=(3, 1))).astype(F32)
        block = (rng.standard_normal((16, d)) * rng.choice([1e-2, 1.0, 1e4])).astype(F32)
        start = rng.standard_normal((3, d)).astype(F32)
        together, alone = start.copy(), start.copy()
        na._block_products(wb, block, together)
        _one_head_at_a_time(wb, block, alone)
        assert np.array_equal(together.view(np.int32), alone.view(np.int32))


def test_a_block_of_odd_length_takes_the_generic_loop():
    """``B`` not a multiple of 4 (the four-row loop's tail): the sums are still each head's
    ``sum_t wb[g, t] v_t`` within FP32's rounding."""
    rng = np.random.default_rng(3)
    wb, block = rng.random((3, 7)).astype(F32), rng.standard_normal((7, 8)).astype(F32)
    got = np.zeros((3, 8), F32)
    na._block_products(wb, block, got)
    exact = wb.astype(np.float64) @ block.astype(np.float64)
    bound = 8 * 2.0**-24 * (np.abs(wb.astype(np.float64)) @ np.abs(block.astype(np.float64)))
    assert (np.abs(got - exact) <= bound).all()
