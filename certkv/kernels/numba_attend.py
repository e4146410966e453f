"""Phase 2 of the CPU backend's certified step as one parallel loop nest (numba,
:func:`attend`): each gated head's block softmax from its FP16-key logits (Phase 1's state
reused elsewhere) and canary, the per-block value sums with each value block read once for the
query heads of its kv head, the two-level sums over blocks, the block masses, log-masses and
spreads, and the ranking and boundary checks (eq. 17-18) in its epilogue. The same FP32
operations as the reference (:mod:`certkv.kernels.numba_backend` says in which order)."""

from __future__ import annotations

import numpy as np

from certkv.certify.checks import CANARY_REL
from certkv.certify.fused_cpu import jit, prange
from certkv.certify.halves import decode_half
from certkv.kernels import numba_values as nv
from certkv.kernels.numba_checks import rank_checks
from certkv.kernels.numba_softmax import amax, exp2, shifted, sums
from certkv.kernels.reference import LOG2E, SUM_CHUNK

_F32 = np.float32
_LOG2E = _F32(LOG2E)
_CANARY_REL = _F32(CANARY_REL)
GATED_CHUNK = 64  # blocks whose exponents Phase 2 takes in one pass (its scratch: 64 B floats)


@jit
def _gated_state(s, gate, w, m, total, total2, x, frac, scale):
    """:func:`row_state` of the blocks ``gate [n]`` marks only, from their logits ``s [n, B]``
    (the other blocks' rows of ``w [n, B]``, ``m, total, total2 [n]`` are left as they are):
    their exponents gathered into the scratch row ``x [C]`` (``C / B`` blocks at a time; ``frac,
    scale [C]`` FP64) and taken in one vectorised pass, as :func:`row_state` takes a whole
    row's (block by block, each block's 16 exponentials cost about as much as a row's; the same
    operations on each weight, so the same bits)."""
    n, bsz = s.shape
    per = x.shape[0] // bsz
    b = 0
    while b < n:
        start, i = b, 0
        while b < n and i < per:
            if gate[b]:
                m[b] = shifted(s[b], x[i * bsz:(i + 1) * bsz])
                i += 1
            b += 1
        exp2(x[:i * bsz], x[:i * bsz], frac, scale)
        i = 0
        for c in range(start, b):
            if gate[c]:
                w[c] = x[i * bsz:(i + 1) * bsz]
                total[c], total2[c] = sums(w[c])
                i += 1


@jit
def _canary(s16, s8, delta_b, eps_guard):
    """Whether a gated block's canary fires: some token with a finite INT8 logit ``s8 [B]`` has
    ``|s16 - s8| > Delta_b + eps_guard + 1e-5 |s16|`` (FP16-key logits ``s16 [B]``;
    :func:`certkv.certify.checks.canary_violations`). Every token's test is taken, joined
    with ``|`` and ``&`` rather than ``or`` and ``and``, so the loop vectorises (about 10x
    faster over a SmolLM2 layer's blocks than stopping at the first token that fires)."""
    fired = False
    for t in range(s16.shape[0]):
        x = s16[t]
        slack = delta_b + eps_guard + _CANARY_REL * abs(x)
        fired |= (abs(x - s8[t]) > slack) & (abs(s8[t]) < np.inf)
    return fired


@jit
def _sum_blocks(x, n):
    """``chunked_sum`` of ``x[:n]``: chunks of ``SUM_CHUNK`` then across chunks."""
    total = _F32(0.0)
    for c0 in range(0, n, SUM_CHUNK):
        part = _F32(0.0)
        for b in range(c0, min(c0 + SUM_CHUNK, n)):
            part += x[b]
        total += part
    return total


@jit
def _head_weights(h, s8, s16, state, gate, delta_b, eps_guard, rho, log_mass, spread, canary,
                  w, alphas, scratch):
    """Phase 2's softmax of query head ``h``: every block's state is Phase 1's (``state``: ``m,
    w, total, total2``), except a gated block's, made again from its FP16-key logits (the
    canary on those); a gated block's weights go into its row of ``w [n, B]`` (the other rows
    are left as they are: those blocks' weights stay in Phase 1's). Then the rescalings
    ``alpha_b = e^{m_b - m}`` into ``alphas [n]``, the block masses, log-masses and spreads
    (:func:`certkv.kernels.reference.attend_blocks`). A block's state depends on its own
    logits only, so this is the whole row's state made again, bit for bit. Returns the head's
    total mass. ``scratch``: FP32 ``[4, m]`` and FP64 ``[2, m]``, ``m >= n`` (:func:`attend`)."""
    m8, _, l8, l28 = state
    n = s8.shape[1]
    f32, f64 = scratch
    m_b, l_b, l2_b = f32[0, :n], f32[1, :n], f32[2, :n]
    m_b[:], l_b[:], l2_b[:] = m8[h], l8[h], l28[h]
    gated = False
    for b in range(n):
        canary[h, b] = False
        gated = gated or gate[h, b]
    if gated:  # Phase 1's blocks kept, the gated ones' states from their FP16-key logits
        for b in range(n):
            if gate[h, b]:
                canary[h, b] = _canary(s16[h, b], s8[h, b], delta_b[h, b], eps_guard)
        _gated_state(s16[h], gate[h], w, m_b, l_b, l2_b, f32[3], f64[0], f64[1])
    top = amax(m_b)
    for b in range(n):
        log_mass[h, b] = m_b[b] + np.log(l_b[b])
        alphas[b] = (m_b[b] - top) * _LOG2E
    exp2(alphas, alphas, f64[0], f64[1])
    for b in range(n):  # the block masses
        l_b[b] = alphas[b] * l_b[b]
    total = _sum_blocks(l_b, n)
    for b in range(n):
        rho[h, b] = l_b[b] / total
        spread[h, b] = alphas[b] * np.sqrt(l2_b[b]) / total
    return total


@jit(fastmath={"contract"})
def _block_products(wb, block, o):
    """``o [G, d] += wb [G, B] block``: each of ``G`` heads' ``o[g] += sum_t wb[g, t] v_t`` over
    a block's ``B`` value rows ``block [B, d]``, four rows at a time, the four rows read once for
    every head (a sum of ``B`` products in some order: at most ``B - 1`` additions each, as arith
    item 4 counts; a fused multiply-add rounds once where a product and a sum would twice).
    Three heads (SmolLM2's groups) update all their rows in one pass over the four
    (:func:`_products3`): each element the same expression, bit for bit
    (``tests/kernels/test_numba_attend.py``)."""
    if o.shape[0] == 3 and block.shape[0] % 4 == 0:
        _products3(wb, block, o)
        return
    group = o.shape[0]
    bsz, d = block.shape
    t = 0
    while t + 4 <= bsz:
        v0, v1, v2, v3 = block[t], block[t + 1], block[t + 2], block[t + 3]
        for g in range(group):
            w0, w1, w2, w3 = wb[g, t], wb[g, t + 1], wb[g, t + 2], wb[g, t + 3]
            og = o[g]
            for i in range(d):
                og[i] += (w0 * v0[i] + w1 * v1[i]) + (w2 * v2[i] + w3 * v3[i])
        t += 4
    while t < bsz:
        for g in range(group):
            wt, og = wb[g, t], o[g]
            for i in range(d):
                og[i] += wt * block[t, i]
        t += 1


@jit(fastmath={"contract"})
def _products3(wb, block, o):
    """:func:`_block_products` for three heads and ``B`` a multiple of 4."""
    o0, o1, o2 = o[0], o[1], o[2]
    for t in range(0, block.shape[0], 4):
        v0, v1, v2, v3 = block[t], block[t + 1], block[t + 2], block[t + 3]
        a0, a1, a2, a3 = wb[0, t], wb[0, t + 1], wb[0, t + 2], wb[0, t + 3]
        b0, b1, b2, b3 = wb[1, t], wb[1, t + 1], wb[1, t + 2], wb[1, t + 3]
        c0, c1, c2, c3 = wb[2, t], wb[2, t + 1], wb[2, t + 2], wb[2, t + 3]
        for i in range(block.shape[1]):
            x0, x1, x2, x3 = v0[i], v1[i], v2[i], v3[i]
            o0[i] += (a0 * x0 + a1 * x1) + (a2 * x2 + a3 * x3)
            o1[i] += (b0 * x0 + b1 * x1) + (b2 * x2 + b3 * x3)
            o2[i] += (c0 * x0 + c1 * x1) + (c2 * x2 + c3 * x3)


@jit
def _chunk_values(kv, chunk, weights, alphas, values, vslot, pool, part, scratch):
    """Kv head ``kv``'s share of the weighted value sums over the blocks of ``chunk`` (the
    first level of the two-level sum over blocks: ``SUM_CHUNK`` blocks): each value block read
    once for the ``G`` query heads of the kv head (block ``b`` from the value sources
    ``values``, :func:`~certkv.kernels.numba_values.load`, or, staged, the FP16 bits at row
    ``vslot[kv, b]`` of ``pool [P, B, d]`` converted into ``block16 [B, d]``), the heads'
    per-block products of ``B`` terms with their weights rescaled by ``alphas [G, n]``, summed
    over the chunk's blocks into ``part [G, d]``. ``weights``: the kv head's rows of Phase 2's
    and Phase 1's weights ``[G, n, B]`` each and of the gate ``[G, n]``: a gated block's weights
    are Phase 2's, any other's Phase 1's. ``scratch``: ``o_b [G, d]``, ``block16 [B, d]`` and
    ``wb [G, B]`` (a block's weights times its rescaling, per head)."""
    o_b, block16, wb = scratch
    group, bsz = part.shape[0], block16.shape[0]
    w16, w8, gate = weights
    part[:] = 0.0
    for b in range(chunk * SUM_CHUNK, min((chunk + 1) * SUM_CHUNK, vslot.shape[1])):
        row = vslot[kv, b]
        if row >= 0:
            decode_half(pool[row], block16)
            block, permuted = block16, False
        else:
            block, permuted = nv.load(kv, b, values, block16)
        for g in range(group):
            w, alpha = (w16[g, b] if gate[g, b] else w8[g, b]), alphas[g, b]
            for t in range(bsz):
                wb[g, t] = w[t] * alpha
        o_b[:] = 0.0
        _block_products(wb, block, o_b)
        nv.add_block(part, o_b, permuted)


def attend_scratch(hq: int, n: int, bsz: int, group: int, d: int) -> tuple:
    """:func:`attend`'s scratch: Phase 2's weights ``[H, n, B]``, each head's FP32 ``[4, m]``
    and FP64 ``[2, m]`` rows (:func:`_head_weights`), ``m = max(n, GATED_CHUNK B)``; the FP16
    value rows' slots ``[Hkv, n]`` (int64), the heads' ``alphas [H, n]`` and ``total [H]``;
    per (kv head, chunk of ``SUM_CHUNK`` blocks) task its partial sums ``[Hkv, C, G, d]``
    and :func:`_chunk_values`' ``o_b [G, d]``, decoded block ``[B, d]`` and weights ``[G,
    B]`` (FP32)."""
    m, hkv, chunks = max(n, GATED_CHUNK * bsz), hq // group, (n + SUM_CHUNK - 1) // SUM_CHUNK
    return (np.empty((hq, n, bsz), _F32), np.empty((hq, 4, m), _F32), np.empty((hq, 2, m)),
            np.empty((hkv, n), np.int64), np.empty((hq, n), _F32), np.empty(hq, _F32),
            np.empty((hkv, chunks, group, d), _F32), np.empty((hkv * chunks, group, d), _F32),
            np.empty((hkv * chunks, bsz, d), _F32), np.empty((hkv * chunks, group, bsz), _F32))


@jit(parallel=True)
def attend(group, s8, s16, state, gate, delta_b, eps_guard, values, staged_kv, staged_blk,
            staged_row, pool, checks, out, rho, log_mass, spread, canary, flags, work):
    """Phase 2 over every query head (``[H, ...]`` per head, head ``h`` reading kv head
    ``h // group``) from the INT8 and FP16-key logits ``s8, s16 [H, n, B]`` (``s16`` read
    where ``gate [H, n]`` is set); the values from their sources ``values``
    (:func:`~certkv.kernels.numba_values.sources`: a decoded mirror, or the codes in place);
    the FP16 values at row ``staged_row[i]`` of ``pool [P, B, d]`` (their bits, int16: the
    scratch cache or Tier-2 in place) replace block ``staged_blk[i]`` of kv head
    ``staged_kv[i]``; ``checks``: ``(l8, delta_b,
    promoted, quantized, r)`` or an empty ``r < 1`` for none, flags ``[2, H]`` (ranking,
    boundary); ``work``: its scratch (:func:`attend_scratch`).

    Three parallel loops, each writing its own rows (the same numbers in any schedule): the
    heads' softmax and checks; the value sums of each (kv head, chunk of ``SUM_CHUNK``
    blocks), so that two threads share out even three kv heads; then each head's chunk sums
    added in order and divided by its total mass (the reference's two-level sum)."""
    hq, n = s8.shape[:2]
    hkv, d = hq // group, out.shape[1]
    w, f32, f64, vslot, alphas, total, parts, o_b, blocks, wb = work  # attend_scratch
    vslot[:] = -1
    for i in range(staged_kv.shape[0]):
        vslot[staged_kv[i], staged_blk[i]] = staged_row[i]
    l8, delta_t, promoted, quantized, r = checks
    for h in prange(hq):
        total[h] = _head_weights(h, s8, s16, state, gate, delta_b, eps_guard, rho, log_mass,
                                 spread, canary, w[h], alphas[h], (f32[h], f64[h]))
        if r >= 1:
            rank_checks(h, l8, log_mass, delta_t, promoted, quantized, r, flags[0], flags[1])
    chunks = (n + SUM_CHUNK - 1) // SUM_CHUNK
    w8 = state[1]
    for task in prange(hkv * chunks):
        kv, chunk = task // chunks, task % chunks
        heads = slice(kv * group, (kv + 1) * group)
        _chunk_values(kv, chunk, (w[heads], w8[heads], gate[heads]), alphas[heads], values,
                      vslot, pool, parts[kv, chunk], (o_b[task], blocks[task], wb[task]))
    for h in prange(hq):
        row = out[h]
        row[:] = 0.0
        for chunk in range(chunks):
            row += parts[h // group, chunk, h % group]
        for i in range(d):
            row[i] = row[i] / total[h]
