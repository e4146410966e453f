"""One decode token's append to a CPU store's tail block as a single numba loop (issue 24).

A decode step appends one token per layer: in PyTorch that is about 30 small operators (the
finiteness check, the running key maximum, the tail write, the tail values' norms and centred
radii in FP64 rounded up to FP32, the running maxima, the decoded mirror's tail row), each a
few microseconds of dispatch on a CPU, about a sixth of a certified layer step. Here they are
one call that computes the same numbers: the FP64 norms sum their squares in another order,
which :data:`certkv.cache.store._INFLATE` (``1e-12`` relative on the centred radius) and the
rounding up to FP32 already absorb, as for PyTorch's own reduction order.
:meth:`TieredKVStore.append <certkv.cache.store.TieredKVStore.append>` takes this path for one
token on a CPU store past its first append that completes no block (:func:`covers`);
``tests/cache/test_store.py`` compares it with the PyTorch path on every field.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from certkv.certify.fused_cpu import AVAILABLE, jit
from certkv.certify.halves import decode_half

_F32 = np.float32


@jit
def _round_up(x):
    """FP64 ``x`` to the smallest FP32 at or above it (:func:`certkv.quant.base.round_up_fp32`)."""
    y = _F32(x)
    return np.nextafter(y, _F32(np.inf)) if np.float64(y) < x else y


def covers(k: torch.Tensor, device: torch.device, tail_len: int, block_size: int) -> bool:
    """Whether :func:`append` can serve an append of ``k [Hkv, T, d]``: numba is there, one
    token on a CPU store that completes no block."""
    return AVAILABLE and k.shape[1] == 1 and device.type == "cpu" and tail_len + 1 < block_size


@jit
def append(k_bits, v_bits, tail_k, tail_v, pos, centre, key_abs_max, block_maxima,
            tail_maxima, value_maxima, inflate, mirror, mirror_k, mirror_orig, mirror_v,
            mirror_bias, scratch):
    """One token ``k_bits, v_bits [Hkv, 1, d]`` (FP16 bits) into row ``pos`` of the tail
    buffers ``tail_k, tail_v [Hkv, B, d]`` (bits), unless some element is NaN or infinite
    (then nothing is written and False returned). Updates in place the running ``|k|``
    maximum ``key_abs_max [Hkv, d]``, the tail's maxima ``tail_maxima [2, Hkv]`` of
    ``||v_t||`` and ``||v_t - c|| (1 + 1e-12)`` (FP64, rounded up) and ``value_maxima [2,
    Hkv]``, their maxima with ``block_maxima``; with ``mirror``, the token also lands in the
    decoded mirror's tail row (keys and original keys ``[Hkv, B, d]``, values, slot bias
    ``[B]`` set to 0). ``scratch [2, 1, d]`` FP32. Returns whether the token was finite."""
    hkv, _, d = k_bits.shape
    for h in range(hkv):
        for c in range(d):  # exponent bits all ones: infinite or NaN
            if (k_bits[h, 0, c] & 0x7C00) == 0x7C00 or (v_bits[h, 0, c] & 0x7C00) == 0x7C00:
                return False
    k32, v32 = scratch[0], scratch[1]
    for h in range(hkv):
        decode_half(k_bits[h], k32)
        decode_half(v_bits[h], v32)
        norm2, radius2 = 0.0, 0.0
        for c in range(d):
            tail_k[h, pos, c], tail_v[h, pos, c] = k_bits[h, 0, c], v_bits[h, 0, c]
            key_abs_max[h, c] = max(key_abs_max[h, c], abs(k32[0, c]))
            x = np.float64(v32[0, c])
            norm2 += x * x
            dev = x - np.float64(centre[h, c])
            radius2 += dev * dev
        tail_maxima[0, h] = max(tail_maxima[0, h], _round_up(math.sqrt(norm2)))
        tail_maxima[1, h] = max(tail_maxima[1, h], _round_up(math.sqrt(radius2) * inflate))
        value_maxima[0, h] = max(block_maxima[0, h], tail_maxima[0, h])
        value_maxima[1, h] = max(block_maxima[1, h], tail_maxima[1, h])
        if mirror:
            for c in range(d):
                mirror_k[h, pos, c] = k32[0, c]
                mirror_orig[h, pos, c] = k32[0, c]
                mirror_v[h, pos, c] = v32[0, c]
    if mirror:
        for row in range(mirror_bias.shape[0]):
            mirror_bias[row, pos] = 0.0
    return True
