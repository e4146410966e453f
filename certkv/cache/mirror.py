"""The decoded mirror's fields: what a store keeps decoded for the CPU's products
(:class:`~certkv.cache.store.TieredKVStore`'s ``decoded_mirror``)."""

from __future__ import annotations

from certkv.errors import ConfigError, require
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import is_int8
from certkv.quant.precision import Precision

#: The decoded mirror's tensors (:class:`TieredKVStore`'s ``decoded_mirror``) and the value of
#: its spare (tail) block's empty slots: decoded keys, values block-major, per-channel key
#: bounds, the original keys in FP32 and the slot bias.
MIRROR_FILL = {"k": 0.0, "v": 0.0, "bound": 0.0, "orig_k": 0.0, "bias": float("-inf")}


def mirror_fields(kind: bool | str, precisions: list[Precision], protected: bool,
                  originals: bool) -> tuple[str, ...]:
    """The tensors a decoded mirror of ``kind`` keeps (:class:`TieredKVStore`'s
    ``decoded_mirror``): none, all of :data:`MIRROR_FILL`, or, ``"lean"``, the values (none
    where they are 4-bit group codes the loops decode in place: :func:`values_in_place`), key
    bounds and slot bias only where every block's keys are either the one INT8 precision's
    codes (which the CPU loops decode in place) or exact windows (read from their FP16
    originals: ``originals``, the store keeps Tier-2), unprotected; all of them elsewhere
    (other key codecs, and evicted blocks' summaries, whose naive steps take the reference's
    products over the decoded and original keys)."""
    if kind is False or kind is None:
        return ()
    if kind is True:
        return tuple(MIRROR_FILL)
    require(kind == "lean", ConfigError,
            f"decoded_mirror={kind!r} is not a mirror; use True, False or 'lean'.")
    codecs = [p.key_codec for p in precisions]
    keys_elsewhere = (originals and not protected and sum(map(is_int8, codecs)) == 1
                      and all(is_int8(c) or p.exact for c, p in zip(codecs, precisions,
                                                                     strict=True)))
    if not keys_elsewhere:
        return tuple(MIRROR_FILL)
    return ("bound", "bias") if values_in_place(precisions, protected, originals) \
        else ("v", "bound", "bias")


def values_in_place(precisions: list[Precision], protected: bool, originals: bool) -> bool:
    """Whether the CPU loops read a store's values without a decoded copy
    (:mod:`certkv.kernels.numba_values`): kept originals, no protection, and every precision
    exact but one, whose values are 4-bit group codes (an even group)."""
    codecs = [p.value_codec for p in precisions if not p.exact]
    return (originals and not protected and len(codecs) == 1
            and type(codecs[0]) is GroupAffineValueCodec and codecs[0].bits == 4
            and codecs[0].group % 2 == 0)


