"""How the fused kernels read a codec's blocks, as the codec declares it
(:meth:`~certkv.quant.base.KeyCodec.kernel_layout`): the pipeline asks a codec for its layout,
never for its type. A subclass that overrides how blocks are encoded or decoded loses its
parent's claim (:func:`keeps`), so the kernels never read codes they do not understand."""

from __future__ import annotations

from dataclasses import dataclass

from certkv.registry import inherits

KERNEL_BITS = (2, 3, 4, 8)  # code widths the kernels unpack (3 bits: 8 codes per 3 bytes)


@dataclass(frozen=True)
class CodeLayout:
    """How a kernel decodes one precision's blocks (compile-time constants of a launch).

    ``fp16``: stored originals (``bits = 16``); else affine codes ``bits`` wide, ``bias``
    subtracted from the unsigned code, ``bound = (a, b)`` of ``r_c = a scale_c + b |offset_c|``
    (keys; Delta_b, eq. 8) and ``group`` channels per scale (values). ``token_scale``: symmetric
    codes with one scale per token and no offset, ``x = (code - bias) scale_t`` (SmartKV's),
    the keys' channel bound ``a max_t scale_t`` (values: ``group`` is the head dimension).
    ``inner``: InnerQ's groups along the reduced dimension (seed 002), keys per token over
    ``group`` channels, values per channel over the block's tokens; each group an FP16 scale
    ``S``, an int32 slot (an FP32 zero-point ``Z``, or the group's sign bits) and a mode bit
    (packed ``mode`` flags): ``x = q S + Z``, or ``+-m S`` where symmetric; the keys' channel
    bound ``max_t (a S + b |Z|)`` over the block's tokens (``|Z|`` of asymmetric groups only),
    times ``2^e_c`` where ``norm`` (per-channel exponents of the block).
    ``subspaces``: codes of rotated coordinates (seed 004's rotation archive,
    :mod:`certkv.quant.rotation`), a scale and an offset per token per subspace of ``d /
    subspaces`` channels, ``z = code s + o``, rotated back as ``x = z (H D)`` with the source's
    FP32 ``basis [d, d]`` (entries +-1) in one FP32 matmul; the keys' channel bound, the same
    for every channel, ``g max_t (a sum_j s_tj + (b + (d + 2) u) sum_j zmax_tj)``: the
    codec's own ``(a, b)`` plus its ``decode_slack`` for any FP32 evaluation of the rotation
    (0: not rotated).
    ``codebook``: values ``x = L[code] S`` with the codec's FP32 levels ``L`` (the source's
    ``levels``) and an FP16 absmax ``S`` per token per ``group`` channels (normal-float codes);
    ``outliers``: each block's exact sparse entries (flat index ``t d + c`` and FP16 value, a
    fixed count per block) replace the dense decode there (KVQuant's dense-and-sparse values).
    ``rope``: pre-RoPE keys (KVQuant's), plain affine per-channel codes as above, rotated to
    post-RoPE in registers with FP32 cosines and sines of the stored positions' angles
    (``x'_c = a (x_c cos - x_c+d/2 sin)``, ``x'_c+d/2 = a (x_c+d/2 cos + x_c sin)``); the keys'
    channel bound is the codec's (:meth:`~certkv.quant.prerope.PreRoPEKeyCodec.channel_bound`)
    plus its ``decode_slack``, from the inner codes' ``bound`` and ``slack`` coefficients
    ``(a, b)`` of ``a scale_c + b |offset_c|``, evaluated in FP32 with a relative margin.
    """

    fp16: bool
    bits: int = 16
    bias: int = 0
    bound: tuple[float, float] = (0.0, 0.0)
    group: int = 1
    token_scale: bool = False
    inner: bool = False
    norm: bool = False
    subspaces: int = 0
    codebook: bool = False
    outliers: bool = False
    rope: bool = False
    slack: tuple[float, float] = (0.0, 0.0)


def keeps(codec, owner: type) -> bool:
    """Whether ``codec`` encodes, decodes and bounds as ``owner`` does (:func:`certkv.registry.
    inherits` over the methods a kernel layout stands for), so ``owner``'s claims hold for it."""
    return inherits(codec, owner, "encode", "decode", "encode_at", "bound_coefficients",
                    "codes", "token_bound", "channel_bound")
