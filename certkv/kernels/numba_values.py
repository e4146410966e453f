"""Phase 2's value blocks on a CPU store whose lean decoded mirror keeps no values: the 4-bit
group codes decoded in place, block by block, instead of an FP32 copy of every value.

A store whose value codecs are the one 4-bit group codec (the default ``int8_int4``) and exact
windows, unprotected and keeping its FP16 originals, keeps no decoded values
(:func:`~certkv.cache.mirror.values_in_place`): Phase 2 reads 0.6-0.75 bytes per value (4-bit
codes, an FP16 scale and offset per group of 16 or 32) instead of 4, and the store holds about
0.6x a dense FP16 cache besides Tier-2, not 1.6x. A quantized block is decoded once per kv head
and step for the ``G`` query heads that read it, with its channels de-interleaved (the low
nibbles' then the high nibbles', so that the loops vectorise): :func:`load` says so and the
value sum adds the block's products back in channel order, each channel's sum over the block's
tokens taken in the same order as from a mirror. Decoding is the codec's own ``code * s + o`` in
FP32, so the values are the whole mirror's bit for bit and so is every step. Exact windows and
the tail block come from their FP16 bits (Tier-2 rows, the tail buffer).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from certkv.cache.blocks import head_rows
from certkv.certify.fused_cpu import as_array, jit, kept_bits
from certkv.certify.halves import decode_half, half_float
from certkv.kernels.numba_logits import same_objects

_F32 = np.float32
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> (counts, parts, codes)


def sources(store, lay) -> tuple:
    """What :func:`load` reads for ``lay``'s blocks: ``(mirror [n, Hkv, B, d] FP32, has
    mirror, slot [n], codes [R, B, d/2], scale, offset [R, B, d/g] (FP16 bits), W, g, value
    originals' bits [R', B, d], W', completed blocks, tail bits [Hkv, B, d])``: the decoded
    values where the store keeps them (or decodes them now: a store without a mirror), else,
    where a lean mirror keeps none (:func:`~certkv.cache.mirror.values_in_place`), the codes in
    place (``slot[b]`` block ``b``'s row in them, -1 elsewhere)."""
    mirrored = store.decoded_with_tail()
    if mirrored is None:  # no mirror: decoded now
        return as_array(lay.values.transpose(0, 1)), True, *_NO_CODES
    if mirrored[1] is not None:
        return as_array(mirrored[1].transpose(0, 1)), True, *_NO_CODES
    return _NO_MIRROR, False, *_codes(store)  # a lean mirror keeps none where they are 4-bit


_NO_MIRROR = np.zeros((1, 1, 1, 1), _F32)
_NO_BITS = np.zeros((1, 1, 1), np.int16)
_NO_CODES = (np.zeros(1, np.int64), np.zeros((1, 1, 1), np.uint8), _NO_BITS, _NO_BITS, 0, 2,
             _NO_BITS, 0, 0, _NO_BITS)


def _codes(store) -> tuple:
    """The in-place part of :func:`sources` (made again when the block count, the tail's
    presence or the store's value buffers change)."""
    groups = store.block_groups("value")
    counts = (store.num_blocks, store.tail_len > 0)
    parts = tuple(x for group in groups for x in group[1:])  # codes, blocks, slots
    cached = _SOURCES.get(store)
    if cached is None or cached[0] != counts or not same_objects(cached[1], parts):
        cached = counts, parts, _in_place_codes(store, groups)  # parts kept: ids stay unique
        _SOURCES[store] = cached
    slot, codes, scale, offset, width, group = cached[2]
    v16, vwidth = (store.original_rows()[1:] if store.num_blocks else (None, 0))
    bits = _NO_BITS if v16 is None else kept_bits(v16)
    return (slot, codes, scale, offset, width, group, bits, vwidth, store.num_blocks,
            kept_bits(store.tail_buffers()[1]))


def _in_place_codes(store, groups) -> tuple:
    """``(slot [n], codes, scale, offset, W, g)`` of the 4-bit precision's blocks."""
    n = store.num_blocks + (1 if store.tail_len else 0)
    slot = np.full(n, -1, np.int64)
    for precision, codes, blocks, slots in groups:
        if precision.exact:
            continue
        slot[as_array(blocks)] = as_array(slots)
        parts = [head_rows(codes[name]) for name in ("codes", "scale", "offset")]
        if len({width for _, width in parts}) > 1:  # one width indexes all three
            parts = [head_rows(codes[name].contiguous()) for name in ("codes", "scale", "offset")]
        (c, width), (s, _), (o, _) = parts
        return (slot, c.numpy(), s.view(torch.int16).numpy(), o.view(torch.int16).numpy(),
                width, precision.value_codec.group)
    return (slot, *_NO_CODES[1:6])


@jit
def load(kv, b, src, block):
    """Block ``b`` of kv head ``kv`` from the sources ``src`` (:func:`sources`) as FP32
    ``[B, d]``: the mirror's row, or decoded into ``block`` (scratch). Returns ``(values,
    permuted)``: ``permuted`` when its channels come de-interleaved (:func:`_decode`)."""
    mirror, has_mirror, slot, codes, sbits, obits, width, group, v16, vwidth, completed, tail = src
    if has_mirror:
        return mirror[b, kv], False
    row = slot[b]
    if row >= 0:
        at = kv * width + row
        _decode(codes[at], sbits[at], obits[at], group, block)
        return block, True
    decode_half(tail[kv] if b >= completed else v16[kv * vwidth + b], block)
    return block, False


@jit
def _decode(codes, sbits, obits, group, block):
    """4-bit codes ``[B, d/2]`` (channel ``2j`` in byte ``j``'s low nibble, ``2j + 1`` in its
    high one) with their FP16 scales and offsets' bits ``sbits, obits [B, d/g]`` decoded as
    ``code * s + o`` in FP32, the product and the sum each rounded (as the codec's own
    ``decode``: the decoded mirror's values, bit for bit), into ``block [B, d]``
    de-interleaved: channel ``2j`` at column ``j``, ``2j + 1`` at ``d/2 + j``. Token by token,
    group by group: its scale and offset converted exactly
    (:func:`~certkv.certify.halves.half_float`), then its codes."""
    bsz, half = codes.shape
    per, count = group // 2, sbits.shape[1]
    for t in range(bsz):
        row, lo, hi = codes[t], block[t, :half], block[t, half:]
        for k in range(count):
            s, o, base = half_float(sbits[t, k]), half_float(obits[t, k]), k * per
            for j in range(per):
                c = row[base + j]
                lo[base + j] = _F32(c & np.uint8(15)) * s + o
                hi[base + j] = _F32(c >> np.uint8(4)) * s + o


@jit
def add_block(part, o_b, permuted):
    """``part [G, d] += o_b [G, d]``, ``o_b``'s channels de-interleaved where ``permuted``."""
    group, d = part.shape
    half = d // 2
    if not permuted:
        for g in range(group):
            part[g] += o_b[g]
        return
    for g in range(group):
        for j in range(half):
            part[g, 2 * j] += o_b[g, j]
            part[g, 2 * j + 1] += o_b[g, half + j]
