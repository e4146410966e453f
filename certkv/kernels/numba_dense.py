"""Rungs 3-4 on a CPU store as one numba call: dense attention of the flagged query heads over
the FP16 originals read in place (Tier-2's completed blocks and the tail buffer), without the
gather, concatenation, FP32 copies and padding of
:func:`~certkv.kernels.reference.prescaled_attention` (a layer's fallback at
16K tokens, d = 128, took about 3x the dense step that way).

The arithmetic is the prescaled chain :func:`~certkv.kernels.reference.dense_rounding` states for
the host fallback: a query divided by a power of two ``f >= |q|_inf`` (exact), FP32 dot products
in any order times the scaling, ``e^{(s - max) f}`` (libm's ``exp``), each weight times its value,
sums in two levels over chunks of :data:`~certkv.kernels.reference.DENSE_CHUNK` tokens (at most
``DENSE_CHUNK - 1`` additions in a chunk, then one per chunk, in order) and the division; fused
multiply-adds only drop roundings. ``tests/kernels/test_numba_dense.py`` holds it to the
reference and to FP64 attention within that chain's bound.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from certkv.certify.fused_cpu import AVAILABLE, jit, kept_bits, prange, use_threads
from certkv.certify.halves import decode_half
from certkv.kernels.reference import DENSE_CHUNK

_F32 = np.float32


def covers(store, q: torch.Tensor) -> bool:
    """Whether :func:`dense_rows` attends ``q``'s rows on ``store``: numba present, a CPU store
    and an FP32 or lower-precision query (FP64 queries keep the reference's FP64 chain)."""
    return AVAILABLE and store.device.type == "cpu" and q.dtype != torch.float64


def dense_heads(q: torch.Tensor, heads: torch.Tensor, store, scaling: float) -> torch.Tensor:
    """:func:`dense_rows` of the query ``heads [m]`` (indices) of ``q [Hq, d]``, each on its
    kv head."""
    heads = heads.cpu()
    return dense_rows(q[heads], heads // (q.shape[0] // store.num_kv_heads), store, scaling)


def dense_rows(q: torch.Tensor, kv_of: torch.Tensor, store, scaling: float) -> torch.Tensor:
    """Dense attention ``[m, d]`` FP32 of query rows ``q [m, d]``, row ``i`` on kv head
    ``kv_of[i]`` (host int64), over every token of ``store`` (:func:`covers`)."""
    m, d = q.shape
    bsz = store.block_size
    if store.num_blocks:
        keys, values, width = store.original_rows()
        keys, values = kept_bits(keys), kept_bits(values)
    else:
        keys = values = np.zeros((1, bsz, d), np.int16)
        width = 0
    tail_k, tail_v = (kept_bits(x) for x in store.tail_buffers())
    tokens = store.num_blocks * bsz + store.tail_len
    chunks = max(1, math.ceil(tokens / DENSE_CHUNK))
    qf = q.float()
    _, exponent = torch.frexp(qf.abs().amax(dim=-1, keepdim=True))  # |q| < 2^exponent
    f = torch.ldexp(torch.ones_like(qf[:, :1]), exponent.clamp(0, 127))
    out = np.empty((m, d), _F32)
    use_threads(torch.get_num_threads())
    _dense(np.ascontiguousarray((qf / f).numpy()), np.ascontiguousarray(f[:, 0].numpy()),
           np.ascontiguousarray(kv_of.numpy()), _F32(scaling),
           (keys, values, width, store.num_blocks), (tail_k, tail_v, store.tail_len), chunks, out)
    return torch.from_numpy(out)


@jit
def _load(rows, tail_rows, width, completed, h, b, block):
    """Block ``b`` of kv head ``h`` decoded into ``block [B, d]`` FP32 from its FP16 bits:
    Tier-2's row ``h W + b`` (``rows [R, B, d]``) for a completed block, else the tail buffer's
    ``tail_rows [Hkv, B, d]``."""
    decode_half(tail_rows[h] if b >= completed else rows[h * width + b], block)


@jit(fastmath={"reassoc", "contract"})
def _chunk_logits(qs, h, start, stop, originals, tail, scaling, block, s):
    """The prescaled logits ``s[t - start] = (q/f . k_t) * scaling`` of tokens ``[start,
    stop)`` on kv head ``h`` (dot products in any order); ``block [B, d]`` scratch."""
    keys, _, width, completed = originals
    tail_k, _, _ = tail
    bsz, d = block.shape
    t = start
    while t < stop:
        b = t // bsz
        _load(keys, tail_k, width, completed, h, b, block)
        end = min(stop, (b + 1) * bsz)
        for u in range(t, end):
            row = block[u - b * bsz]
            acc = _F32(0.0)
            for c in range(d):
                acc += qs[c] * row[c]
            s[u - start] = acc * scaling
        t = end


@jit(fastmath={"contract"})
def _chunk_values(h, start, stop, w, originals, tail, block, num):
    """``num [d] = sum_t w[t - start] v_t`` over tokens ``[start, stop)`` of kv head ``h``, in
    token order (at most ``stop - start - 1`` additions per term)."""
    _, values, width, completed = originals
    _, tail_v, _ = tail
    bsz, d = block.shape
    num[:] = 0.0
    t = start
    while t < stop:
        b = t // bsz
        _load(values, tail_v, width, completed, h, b, block)
        end = min(stop, (b + 1) * bsz)
        for u in range(t, end):
            wt, row = w[u - start], block[u - b * bsz]
            for c in range(d):
                num[c] += wt * row[c]
        t = end


@jit(parallel=True)
def _dense(scaled, f, kv_of, scaling, originals, tail, chunks, out):
    """:func:`dense_rows`'s loops: the logits of every (row, chunk) in parallel, each row's
    maximum, the weights and each chunk's numerator and denominator in parallel, then each
    row's chunk sums in order and the division. ``scaled [m, d]``: the query rows divided by
    their powers of two ``f [m]`` (exact); ``originals``: the completed blocks' key and
    value bits ``[R, B, d]`` (block ``b`` of kv head ``h`` at row ``h W + b``), ``W`` and the
    completed block count; ``tail``: the tail buffers' bits ``[Hkv, B, d]`` and their fill."""
    m, d = scaled.shape
    bsz = originals[0].shape[1]
    tokens = originals[3] * bsz + tail[2]
    s = np.empty((m, chunks * DENSE_CHUNK), _F32)
    for task in prange(m * chunks):
        i, c = task // chunks, task % chunks
        start, stop = c * DENSE_CHUNK, min(tokens, (c + 1) * DENSE_CHUNK)
        _chunk_logits(scaled[i], kv_of[i], start, stop, originals, tail, scaling,
                      np.empty((bsz, d), _F32), s[i, start:stop])
    top = np.empty(m, _F32)
    for i in range(m):
        best = _F32(-np.inf)
        for t in range(tokens):
            best = s[i, t] if (s[i, t] > best or s[i, t] != s[i, t]) else best
        top[i] = best
    num, den = np.empty((m, chunks, d), _F32), np.zeros((m, chunks), _F32)
    for task in prange(m * chunks):
        i, c = task // chunks, task % chunks
        start, stop = c * DENSE_CHUNK, min(tokens, (c + 1) * DENSE_CHUNK)
        w = s[i, start:stop]
        for t in range(stop - start):
            w[t] = np.exp((w[t] - top[i]) * f[i])
        total = _F32(0.0)
        for t in range(stop - start):
            total += w[t]
        den[i, c] = total
        _chunk_values(kv_of[i], start, stop, w, originals, tail, np.empty((bsz, d), _F32),
                      num[i, c])
    for i in prange(m):
        row, total = out[i], _F32(0.0)
        row[:] = 0.0
        for c in range(chunks):
            row += num[i, c]
            total += den[i, c]
        for j in range(d):
            row[j] = row[j] / total
