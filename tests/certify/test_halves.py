"""FP16 bits to FP32 in the numba kernels (:mod:`certkv.certify.halves`): exact, bitwise PyTorch's
conversion (the reference's and the mirror's) on every half, by both ways the module has."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from certkv.certify import halves
from certkv.certify.fused_cpu import AVAILABLE, jit

ALL = np.arange(65536, dtype=np.uint16).view(np.int16).reshape(256, 256)
WANT = torch.from_numpy(ALL.copy()).view(torch.float16).float().numpy().view(np.int32)


@jit
def _scalars(convert, bits, out):
    for i in range(bits.shape[0]):
        for j in range(bits.shape[1]):
            out[i, j] = convert(bits[i, j])


BLOCKS = [halves._decode_bits] + ([halves._KERNELS[1]] if halves._KERNELS else [])
SCALARS = [halves._half_bits] + ([halves._KERNELS[0]] if halves._KERNELS else [])


@pytest.mark.parametrize("decode", BLOCKS, ids=lambda f: f.__name__)
def test_every_half_converts_as_pytorch_does_block_by_block(decode):
    """All 65,536 bit patterns (zeros, subnormals, infinities, NaNs quieted as the CPU and
    PyTorch quiet them) as one ``[256, 256]`` block."""
    out = np.empty((256, 256), np.float32)
    decode(ALL, out)
    assert np.array_equal(out.view(np.int32), WANT)


@pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")
@pytest.mark.parametrize("convert", SCALARS, ids=lambda f: f.__name__)
def test_every_half_converts_as_pytorch_does_one_by_one(convert):
    """The scalar conversion the 4-bit value decode uses for scales and offsets."""
    out = np.empty((256, 256), np.float32)
    _scalars(convert, ALL, out)
    assert np.array_equal(out.view(np.int32), WANT)


def test_the_kernels_use_the_native_conversion_where_the_probe_passed():
    """On a machine whose numba lowers ``fpext`` from half (every x86-64 with F16C, ARM64) the
    kernels get the one-instruction conversion; the probe itself checks all halves."""
    if halves.NATIVE:
        assert halves.decode_half is halves._KERNELS[1]
        assert halves.half_float is halves._KERNELS[0]
    else:
        assert halves.decode_half is halves._decode_bits
