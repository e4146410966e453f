"""The CPU backend's logits (Alg. 1 Phase 1, and Phase 2's FP16-key logits) as numba loops
that read INT8 key codes where the store keeps them (issue 24).

Phase 1's logits were a BLAS ``baddbmm`` over the decoded FP32 mirror: 4 bytes per key
channel, cold in the caches after a layer's MLP (the mirrors of all layers exceed them; one
layer at 4K, d = 128, 8 kv heads: 0.42 ms warm, 0.84 ms cold on this 2-core machine, against
0.35 / 0.47 ms here). Here a block of INT8 codes (1 byte per channel)
is decoded into a small FP32 scratch as the mirror decodes it, ``code * scale + offset`` with
the same two roundings (so the keys are bitwise the mirror's), and its ``G x B`` logits are dot
products from that scratch; blocks of any other precision (FP16 windows, the tail block, other
codecs) are copied into it from the mirror. The FP16-key logits Phase 2 needs are the same dot
products for the blocks some head gates only, their FP16 originals read in place from Tier-2
and converted exactly (:func:`~certkv.certify.halves.decode_half`), so the canary compares two
logits of one kind of product. Every block is read as C-contiguous rows of its buffer
(:func:`rows`, as the store's Tier-2 rows): numba's loops over a strided view ran several times
slower.

A logit is ``scaling * (q . k)`` plus the slot bias (0, or ``-inf`` on the tail block's empty
slots), as the reference's ``baddbmm(bias, q, k^T, alpha=scaling)``; its dot product sums
``d`` terms in an order the vectoriser picks (reassociation allowed), which arith item 1
covers: it counts ``d`` roundings per logit, in any order.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from certkv.cache.blocks import head_rows
from certkv.certify.fused_cpu import as_array, jit, kept, kept_bits, prange
from certkv.certify.halves import decode_half
from certkv.quant.int8_channel import is_int8

_F32 = np.float32
PARTS = 2  # block ranges per kv head: two threads share out even one or three kv heads


@jit(fastmath={"reassoc", "contract"})
def _dots(q, keys, bias, scaling, out):
    """``out [G, B] = scaling * q keys^T + bias`` for ``q [G, d]``, one block's FP32 keys
    ``keys [B, d]`` (always the callers' C-contiguous scratch: one compiled loop, so the
    INT8 and FP16-key logits of a block take the same operations) and its slot bias ``[B]``.
    Groups of 3 and 4 heads (SmolLM2, Llama-3) read each key once for all their heads
    (:func:`_dots3`, :func:`_dots4`): each dot product the one-head loop's sum
    (:func:`_dots_any`) bit for bit (compared in ``tests/kernels/test_numba_logits.py``)."""
    group = q.shape[0]
    if group == 3:
        _dots3(q, keys, bias, scaling, out)
        return
    if group == 4:
        _dots4(q, keys, bias, scaling, out)
        return
    _dots_any(q, keys, bias, scaling, out)


@jit(fastmath={"reassoc", "contract"})
def _dots3(q, keys, bias, scaling, out):
    """:func:`_dots` for three heads: one pass over each key, three sums."""
    q0, q1, q2 = q[0], q[1], q[2]
    for t in range(keys.shape[0]):
        key = keys[t]
        a0, a1, a2 = _F32(0.0), _F32(0.0), _F32(0.0)
        for c in range(q.shape[1]):
            k = key[c]
            a0 += q0[c] * k
            a1 += q1[c] * k
            a2 += q2[c] * k
        out[0, t] = a0 * scaling + bias[t]
        out[1, t] = a1 * scaling + bias[t]
        out[2, t] = a2 * scaling + bias[t]


@jit(fastmath={"reassoc", "contract"})
def _dots4(q, keys, bias, scaling, out):
    """:func:`_dots` for four heads: one pass over each key, four sums."""
    q0, q1, q2, q3 = q[0], q[1], q[2], q[3]
    for t in range(keys.shape[0]):
        key = keys[t]
        a0, a1, a2, a3 = _F32(0.0), _F32(0.0), _F32(0.0), _F32(0.0)
        for c in range(q.shape[1]):
            k = key[c]
            a0 += q0[c] * k
            a1 += q1[c] * k
            a2 += q2[c] * k
            a3 += q3[c] * k
        out[0, t] = a0 * scaling + bias[t]
        out[1, t] = a1 * scaling + bias[t]
        out[2, t] = a2 * scaling + bias[t]
        out[3, t] = a3 * scaling + bias[t]


@jit(fastmath={"reassoc", "contract"})
def _dots_any(q, keys, bias, scaling, out):
    """:func:`_dots` for any number of heads, one head at a time."""
    group, d = q.shape
    for g in range(group):
        row = q[g]
        for t in range(keys.shape[0]):
            key = keys[t]
            acc = _F32(0.0)
            for c in range(d):
                acc += row[c] * key[c]
            out[g, t] = acc * scaling + bias[t]


@jit
def _decode(codes, scale, offset, keys):
    """One block's INT8 keys ``codes [B, d]`` decoded into ``keys [B, d]`` as the codec (and
    the mirror) decodes them: ``code * scale + offset`` in FP32, a product then a sum (no fused
    multiply-add), so the result is bitwise the mirror's."""
    for t in range(codes.shape[0]):
        for c in range(codes.shape[1]):
            keys[t, c] = _F32(codes[t, c]) * scale[c] + offset[c]


@jit
def _tail_keys(tail, fill, keys):
    """The partial tail block's keys: the FP16 tail buffer's bits ``tail [B, d]`` converted
    exactly into ``keys [B, d]``, its ``fill`` tokens, zeros on the empty slots (as the
    mirror's zero-padded tail row; their logits are the slot bias's ``-inf``)."""
    decode_half(tail, keys)
    keys[fill:] = 0.0


@jit(parallel=True)
def _key_logits(group, q, keys, bias, scaling, s):
    """Phase 1's logits ``s [H, n, B]`` of query heads ``q [H, d]`` (head ``h`` reads kv head
    ``h // group``) from the key sources ``keys`` (:func:`logits_range`) and the slot bias
    ``bias [n, B]``. In parallel over (kv head, range of blocks)."""
    n, bsz = bias.shape
    hkv, d = q.shape[0] // group, q.shape[1]
    work = logits_scratch(hkv, bsz, d, group)
    for task in prange(hkv * PARTS):
        logits_range(group, q, keys, task_blocks(task, n), bias, scaling,
                     (work[0][task], work[1][task]), s)


@jit
def task_blocks(task, n):
    """``(owner, lo, hi)`` of parallel task ``task`` over ``n`` blocks: its owner (a kv head or
    query head) ``task // PARTS`` and blocks ``lo <= b < hi``, the ``task % PARTS``-th of
    ``PARTS`` ranges. Every loop nest over blocks splits them so, which is what lets
    :func:`~certkv.kernels.numba_backend._phase1` give the same numbers as the loops it joins."""
    part = task % PARTS
    return task // PARTS, part * n // PARTS, (part + 1) * n // PARTS


@jit
def logits_scratch(hkv, bsz, d, group):
    """:func:`logits_range`'s scratch per (kv head, range of blocks) task: FP32 keys ``[B,
    d]`` and dot products ``[G, B]``."""
    return np.empty((hkv * PARTS, bsz, d), _F32), np.empty((hkv * PARTS, group, bsz), _F32)


@jit
def logits_range(group, q, keys, blocks, bias, scaling, work, s):
    """Phase 1's logits ``s[h, b] [B]`` of kv head ``kv``'s query heads ``h`` for its blocks
    ``lo <= b < hi`` (``blocks = (kv, lo, hi)``). ``keys = (slot, codes, scale, offset, W,
    mirror, W', originals, W'', tail, fill)``: block ``b`` decoded from slot ``slot[b]`` of the
    INT8 code rows ``codes [R, B, d]`` with ``scale, offset [R, d]`` at row ``kv * W +
    slot[b]``; the partial tail block (``fill > 0`` tokens, last) from the FP16 tail buffer's
    bits ``tail [Hkv, B, d]`` (:func:`_tail_keys`); any other block from the FP32 ``mirror``
    rows ``[R', B, d]`` at ``kv * W' + b`` (:func:`rows`), or, where the mirror keeps no keys
    (``W'`` 0: a lean mirror, whose other blocks are exact windows), converted from the bits
    of their FP16 originals ``originals [R'', B, d]`` at row ``kv * W'' + b`` (Tier-2);
    ``bias [n, B]``; ``work``: FP32 keys ``[B, d]`` and dots ``[G, B]`` (scratch)."""
    slot, codes, scale, offset, width, mirror, mirror_width, originals, originals_width, \
        tail, fill = keys
    kv, lo, hi = blocks
    scratch, out = work
    n = bias.shape[0]
    completed = n - 1 if fill else n
    heads = q[kv * group:(kv + 1) * group]
    for b in range(lo, hi):
        if slot[b] >= 0:
            row = kv * width + slot[b]
            _decode(codes[row], scale[row], offset[row], scratch)
        elif b >= completed:
            _tail_keys(tail[kv], fill, scratch)
        elif mirror_width:
            scratch[:] = mirror[kv * mirror_width + b]
        else:
            decode_half(originals[kv * originals_width + b], scratch)
        _dots(heads, scratch, bias[b], scaling, out)
        s[kv * group:(kv + 1) * group, b] = out


@jit(parallel=True)
def _gated_logits(group, q, gate, originals, width, completed, tail, fill, bias, scaling, s,
                  work):
    """The FP16-key logits ``s [H, n, B]`` of the blocks some query head of a kv head gates
    (``gate [Hkv, G, n]``; the others are left as they are): block ``b < completed`` of kv
    head ``kv`` from the FP16 originals' bits ``originals [R, B, d]`` at row ``kv * width +
    b``, the partial tail block from the tail buffer's bits ``tail [Hkv, B, d]`` (``fill``
    tokens, :func:`_tail_keys`); the dot products of :func:`_key_logits`. ``work``:
    :func:`logits_scratch`."""
    hkv, n = gate.shape[0], gate.shape[2]
    keys, dots = work
    for task in prange(hkv * PARTS):
        kv, lo, hi = task_blocks(task, n)
        heads = q[kv * group:(kv + 1) * group]
        scratch, out = keys[task], dots[task]
        for b in range(lo, hi):
            wanted = False
            for g in range(group):
                wanted = wanted or gate[kv, g, b]
            if not wanted:
                continue
            if b < completed:
                decode_half(originals[kv * width + b], scratch)
            else:
                _tail_keys(tail[kv], fill, scratch)
            _dots(heads, scratch, bias[b], scaling, out)
            s[kv * group:(kv + 1) * group, b] = out


def rows(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """:func:`~certkv.cache.blocks.head_rows` as NumPy: C-contiguous rows, so that numba
    compiles contiguous loops over each block. Rows that view ``x``'s memory are made once per
    view (the store's views are the same objects until its buffers change, and writes into
    them show through: :func:`~certkv.certify.fused_cpu.kept`); a contiguous copy is made
    every call."""
    return kept(x, "rows", _rows)


def _rows(x: torch.Tensor) -> tuple[tuple[np.ndarray, int], bool]:
    flat, width = head_rows(x)
    return (flat.numpy(), width), flat.untyped_storage().data_ptr() == \
        x.untyped_storage().data_ptr()


_CODES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> (counts, parts, codes)


def int8_keys(store) -> tuple | None:
    """:func:`_int8_keys`, or None without a decoded mirror; made again only when what it
    reads changes: the block count, the tail block, protection or any of the store's key
    groups (compared by identity: the store replaces them on every change of its table or
    buffers)."""
    if store.decoded_with_tail() is None:
        return None
    groups = [] if store.protection.enabled else store.block_groups("key")
    counts = (store.num_blocks, store.tail_len > 0)
    parts = tuple(x for group in groups for x in group)  # precisions, codes, blocks, slots
    cached = _CODES.get(store)
    if cached is None or cached[0] != counts or not same_objects(cached[1], parts):
        cached = (counts, parts, _int8_keys(store, groups))
        _CODES[store] = cached
    return cached[2]


def same_objects(a: tuple, b: tuple) -> bool:
    """Whether ``a`` and ``b`` hold the same objects in the same order (identity, not ``==``:
    tensors compare elementwise)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def _int8_keys(store, groups) -> tuple:
    """The INT8 codes :func:`key_logits` reads: ``(slot [n], codes [R, B, d], scale, offset
    [R, d], W)``, ``slot[b]`` block ``b``'s slot in the INT8 key codes of the one unprotected
    ``ChannelAffineKeyCodec(bits=8)`` precision (-1: read elsewhere, :func:`_key_logits`: the
    tail block, exact blocks, other codecs, or every block where no such precision holds
    blocks, the store protects its words or two precisions do), from the store's key ``groups``
    (:meth:`~certkv.cache.store.TieredKVStore.block_groups`). The codes are C-contiguous rows
    of their buffers in place (slot ``j`` of kv head ``h`` at row ``h W + j``, as
    :func:`rows`): numba compiles a strided view's loops without vector instructions (about 3x
    slower on SmolLM2's 2K stores, whose code buffers have spare capacity)."""
    n = store.num_blocks + (1 if store.tail_len else 0)
    slot, found = np.full(n, -1, np.int64), []
    if not store.protection.enabled:
        for precision, codes, blocks, slots in groups:
            if is_int8(precision.key_codec):
                slot[as_array(blocks)] = as_array(slots)
                found.append(codes)
    if len(found) != 1:
        return np.full(n, -1, np.int64), *_NO_CODES
    names = ("codes", "scale", "offset")
    parts = [head_rows(found[0][name]) for name in names]
    if len({width for _, width in parts}) > 1:  # the kernel indexes all three with one width
        parts = [head_rows(found[0][name].contiguous()) for name in names]
    (codes, width), (scale, _), (offset, _) = parts
    return slot, codes.numpy(), scale.numpy(), offset.numpy(), width


_NO_CODES = (np.zeros((1, 1, 1), np.int8), np.zeros((1, 1), _F32), np.zeros((1, 1), _F32), 0)


def key_logits(q: torch.Tensor, lay, scaling: float, codes) -> np.ndarray:
    """Phase 1's logits ``[Hkv G, n, B]`` (FP32, ``-inf`` on empty slots) of ``q [Hkv, G,
    d]`` over the step layout's blocks, from ``codes`` (:func:`int8_keys`), the tail buffer
    and the mirror."""
    hkv, group, d = q.shape
    store, n, bsz = lay.store, lay.num_blocks, lay.store.block_size
    s = np.empty((hkv * group, n, bsz), _F32)
    keys = (*codes, *_other_keys(store), *_tail(store))
    _key_logits(group, as_array(q.reshape(-1, d)), keys, as_array(lay.slot_bias.view(n, bsz)),
                _F32(scaling), s)
    return s


def _other_keys(store) -> tuple[np.ndarray, int, np.ndarray, int]:
    """Where :func:`_key_logits` reads the completed blocks that have no INT8 codes: the
    decoded mirror's key rows (:func:`rows`) and a placeholder, or, where a lean mirror keeps
    no keys (its store's other blocks are exact windows:
    :func:`~certkv.cache.mirror.mirror_fields`), a placeholder and the FP16 originals' bits
    (Tier-2 rows in place, as :meth:`~certkv.cache.store.TieredKVStore.original_rows`)."""
    keys = store.decoded_with_tail()[0]
    if keys is not None:
        return *rows(keys), *_NO_ORIGINALS
    return *_NO_MIRROR, *_original_keys(store)


_NO_MIRROR = (np.zeros((1, 1, 1), _F32), 0)
_NO_ORIGINALS = (np.zeros((1, 1, 1), np.int16), 0)


def _original_keys(store) -> tuple[np.ndarray, int]:
    """The completed blocks' FP16 original keys as their bits ``[Hkv W, B, d]`` (int16,
    Tier-2 rows in place: :meth:`~certkv.cache.store.TieredKVStore.original_rows`) and ``W``;
    a placeholder before any block completes."""
    if not store.num_blocks:
        return _NO_ORIGINALS
    k16, _, width = store.original_rows()
    return kept_bits(k16), width


def _tail(store) -> tuple[np.ndarray, int]:
    """The FP16 tail buffer's bits ``[Hkv, B, d]`` (int16) and its fill."""
    return kept_bits(store.tail_buffers()[0]), store.tail_len


def gated_logits(q: torch.Tensor, lay, gate: torch.Tensor, scaling: float) -> np.ndarray:
    """The FP16-key logits ``[Hkv G, n, B]`` of the blocks ``gate [Hkv, G, n]`` asks for
    (undefined elsewhere): the completed blocks from their FP16 originals in place (Tier-2),
    the tail block from the tail buffer (:func:`_gated_logits`)."""
    hkv, group, d = q.shape
    store, n, bsz = lay.store, lay.num_blocks, lay.store.block_size
    s = np.empty((hkv * group, n, bsz), _F32)
    _gated_logits(group, as_array(q.reshape(-1, d)), as_array(gate), *_original_keys(store),
                  store.num_blocks, *_tail(store), as_array(lay.slot_bias.view(n, bsz)),
                  _F32(scaling), s, logits_scratch(hkv, bsz, d, group))
    return s
