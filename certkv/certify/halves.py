"""FP16 bits to FP32 in numba kernels: the FP16 originals (Tier-2 rows, the tail buffer) and the
FP16 scales and offsets of the 4-bit value codes, read as int16 because numba has no float16
type.

Where the CPU converts a half in one instruction (x86-64's F16C, every ARM64), the conversion is
LLVM's ``fpext`` from ``half``, reached through a numba intrinsic: a block's conversion is one
loop that vectorises, and a scalar's one instruction. Elsewhere (:data:`NATIVE` False: the
probe could not compile it, or it disagreed with PyTorch) the half's bits are moved into a
float's and scaled by ``2^112`` (exact for normal and subnormal halves), then infinities and
NaNs and the sign set: three loops over a block. Both are exact and bitwise PyTorch's
conversion (``Tensor.float()``, which the reference and the mirror use), a signaling NaN
included: both return it quieted, as the CPU does (NumPy's ``astype`` keeps it signaling).
``tests/certify/test_halves.py`` checks all 65,536 halves.
"""

from __future__ import annotations

import numpy as np
import torch

from certkv.certify.fused_cpu import AVAILABLE, jit

HALF_SCALE = np.float32(2.0**112)  # 2^(127 - 15): a half's exponent bits placed in a float's


@jit(inline="always")
def half_word(bits, word):
    """The FP32 word of the half ``bits`` given ``word``, its magnitude bits moved and scaled
    (:func:`_decode_bits`' first two steps): infinities and NaNs (exponent 31) set, quieted,
    then the sign bit."""
    h = np.int32(bits)
    magnitude = h & 0x7FFF
    nan_or_inf = 0x7F800000 | ((magnitude & 0x3FF) << 13)
    nan_or_inf = nan_or_inf | 0x400000 if magnitude > 0x7C00 else nan_or_inf  # quiet a NaN
    word = nan_or_inf if magnitude >= 0x7C00 else word
    return word | ((h & 0x8000) << 16)


@jit
def _decode_bits(bits, keys):
    """:func:`decode_half` without the intrinsic: three loops that vectorise (see the module)."""
    out = keys.view(np.int32)
    bsz, d = bits.shape
    for t in range(bsz):
        for c in range(d):
            out[t, c] = (np.int32(bits[t, c]) & 0x7FFF) << 13
    for t in range(bsz):
        for c in range(d):
            keys[t, c] = keys[t, c] * HALF_SCALE
    for t in range(bsz):
        for c in range(d):
            out[t, c] = half_word(bits[t, c], out[t, c])


@jit(inline="always")
def _half_bits(bits):
    """:func:`half_float` without the intrinsic."""
    word = np.empty(1, np.int32)
    word[0] = (np.int32(bits) & 0x7FFF) << 13
    value = word.view(np.float32)
    value[0] = value[0] * HALF_SCALE
    word[0] = half_word(bits, word[0])
    return value[0]


def _native():
    """The intrinsic and the two kernels that use it, or None without numba."""
    if not AVAILABLE:
        return None
    from llvmlite import ir
    from numba.core import types
    from numba.core.extending import intrinsic

    @intrinsic
    def fpext(typingctx, bits):
        if bits != types.int16:
            return None

        def codegen(context, builder, signature, args):
            return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

        return types.float32(types.int16), codegen

    @jit(inline="always")
    def half(bits):
        return fpext(bits)

    @jit
    def decode(bits, keys):
        bsz, d = bits.shape
        for t in range(bsz):
            for c in range(d):
                keys[t, c] = fpext(bits[t, c])

    return half, decode


def _probe(kernels) -> bool:
    """Whether the intrinsic's kernels compile here and convert every half as PyTorch does."""
    if kernels is None:
        return False
    bits = np.arange(65536, dtype=np.uint16).view(np.int16).reshape(256, 256)
    out = np.empty((256, 256), np.float32)
    try:
        kernels[1](bits, out)
    except Exception:  # an LLVM without half lowering, a missing libcall: the bits' way
        return False
    want = torch.from_numpy(bits.copy()).view(torch.float16).float().numpy()
    return bool(np.array_equal(out.view(np.int32), want.view(np.int32)))


_KERNELS = _native()
NATIVE = _probe(_KERNELS)

if NATIVE:
    half_float, decode_half = _KERNELS
else:
    half_float, decode_half = _half_bits, _decode_bits
half_float.__doc__ = """The FP32 value of the half whose bits are ``bits`` (int16), exactly."""
decode_half.__doc__ = """One block of FP16 values as their bits ``bits [B, d]`` (int16)
converted exactly into FP32 ``keys [B, d]``."""
