"""CPU backend: the PyTorch reference's phases with their logits, per-block softmax, value
sums and checks as fused loop nests (numba) (issue 24).

The reference (:mod:`certkv.kernels.reference`) states the phases and the checks as about 130
small PyTorch operators per layer step; on a CPU each costs microseconds of dispatch. Here each
phase is a few parallel loop nests: in Phase 1 the logits from the INT8 key codes and the
decoded mirror (:mod:`certkv.kernels.numba_logits`; a store without a mirror keeps the BLAS
product), then the blocks' softmax state, log-masses, log-spreads and ``Delta_b``
(:func:`_block_states`); in Phase 2 the FP16-key logits of the gated blocks (the same dot
products over the originals), each gated head's block softmax (Phase 1's state reused
elsewhere) and canary, the per-block value sums with each value block read once for the query
heads of its kv head, the two-level sums over blocks, the block masses, log-masses and spreads,
and the ranking and boundary checks (eq. 17-18) in its epilogue (:func:`_attend`).

Every quantity takes the same FP32 operations as the reference, in an order its rounding
chain already allows (:meth:`TorchBackend.rounding`: ``B - 1`` additions inside a block, then
at most ``SUM_CHUNK + n / SUM_CHUNK`` over blocks; ``Delta_b`` and the logits' dot products in
any order), so the arithmetic bound is the reference's; the exponentials are :func:`_exp2`'s,
within the 1 u of ``2^x`` that arith's ``EXP_ULPS`` more than allows. NaN follows PyTorch
(``amax`` propagates it; sorting puts it first). ``fp64_scalars`` runs the reference itself.
Covers every codec: blocks without INT8 key codes are read from the decoded mirror.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from certkv.certify.checks import CANARY_REL
from certkv.certify.fused_cpu import AVAILABLE, as_array, jit, prange, use_threads
from certkv.certify.halves import decode_half
from certkv.kernels import numba_dense
from certkv.kernels import numba_values as nv
from certkv.kernels.numba_checks import rank_checks
from certkv.kernels.numba_logits import PARTS, gated_logits, int8_keys, key_logits
from certkv.kernels.reference import (
    LOG2E,
    SUM_CHUNK,
    Attended,
    BlockSoftmax,
    CheckInputs,
    Scored,
    TorchBackend,
    block_scores,
    block_softmax,
)

_F32 = np.float32
_LOG2E = _F32(LOG2E)
_F32_MIN = _F32(np.finfo(np.float32).min)
_CANARY_REL = _F32(CANARY_REL)
GATED_CHUNK = 64  # blocks whose exponents Phase 2 takes in one pass (its scratch: 64 B floats)


@jit
def _amax(x):
    """``x.amax()`` of a 1-D FP32 array as PyTorch computes it: NaN if any element is."""
    m = _F32(-np.inf)
    for v in x:
        m = v if (v > m or v != v) else m  # NaN, once met, stays (v > NaN is false)
    return m


_EXP2_TAYLOR = tuple(math.log(2.0) ** k / math.factorial(k) for k in range(12))
_MAGIC = float(2**52)  # 2^52 + k holds the integer k in its low mantissa bits
_MAGIC_BITS = 0x4330000000000000  # the bits of 2^52


@jit
def _exp2(x, out, frac, scale):
    """``out [m] = 2^x`` for FP32 ``x [m]`` (``out`` may be ``x``), in loops that vectorize;
    ``frac, scale [>= m]`` FP64 scratch.

    ``x = k + f`` with ``k`` an integer and ``|f| <= 1/2`` (clamped to ``|x| <= 200``: FP32 results
    there are 0 or inf either way); ``2^f`` from its Taylor series to degree 11 in FP64 (relative
    error below 1e-11), ``2^k`` built from its exponent bits, and one rounding to FP32: within 1 u
    of ``2^x`` for normal results, within 2^-150 below them (arith's ``EXP_ULPS = 8`` and ``TINY``
    allow more). NaN stays NaN, ``-inf`` gives 0. ``tests/kernels/test_numba_backend.py`` checks it
    against FP64 ``exp2``."""
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = _EXP2_TAYLOR
    m = x.shape[0]
    for t in range(m):
        xd = np.float64(x[t])
        xc = xd if xd > -200.0 else -200.0
        xc = xc if xc < 200.0 else 200.0
        k = np.floor(xc + 0.5)
        f = xc - k
        p = ((((c11 * f + c10) * f + c9) * f + c8) * f + c7) * f + c6
        frac[t] = (((((p * f + c5) * f + c4) * f + c3) * f + c2) * f + c1) * f + c0
        scale[t] = k + (1023.0 + _MAGIC)
    bits = scale.view(np.int64)
    for t in range(m):
        bits[t] = (bits[t] - _MAGIC_BITS) << 52
    for t in range(m):
        r = _F32(frac[t] * scale[t])
        out[t] = r if x[t] == x[t] else x[t]


@jit(fastmath={"reassoc", "contract"})
def _sums(w):
    """``(sum w, sum w^2)`` of FP32 weights in any order (``B - 1`` additions each, as the
    reference's ``sum`` allows)."""
    acc, acc2 = _F32(0.0), _F32(0.0)
    for x in w:
        acc += x
        acc2 += x * x
    return acc, acc2


@jit
def _shifted(s, out):
    """One block's logits ``s [B]`` shifted for its softmax: ``out [B] = (s - max(m_b, FP32
    min)) log2 e``, the exponents of its weights; returns its max ``m_b`` (NaN if any logit is
    NaN)."""
    mb = _amax(s)
    shift = mb if (mb != mb or mb > _F32_MIN) else _F32_MIN
    for t in range(s.shape[0]):
        out[t] = (s[t] - shift) * _LOG2E
    return mb


@jit
def _row_state(s, w, m, total, total2, frac, scale):
    """The softmax state of one head's blocks from their logits ``s [n, B]`` (``-inf`` on empty
    slots): each block's max ``m [n]``, the weights ``w [n, B] = 2^((s - max(m_b, FP32 min))
    log2 e)`` (C-contiguous), their sums ``total`` and sums of squares ``total2 [n]``
    (:func:`certkv.kernels.reference.block_softmax`; the exponentials in one vectorised pass
    over the row, :func:`_exp2` with scratch ``frac, scale [n B]``)."""
    n, bsz = s.shape
    for b in range(n):
        m[b] = _shifted(s[b], w[b])
    flat = w.reshape(n * bsz)
    _exp2(flat, flat, frac, scale)
    for b in range(n):
        total[b], total2[b] = _sums(w[b])


@jit
def _gated_state(s, gate, w, m, total, total2, x, frac, scale):
    """:func:`_row_state` of the blocks ``gate [n]`` marks only, from their logits ``s [n, B]``
    (the other blocks' rows of ``w [n, B]``, ``m, total, total2 [n]`` are left as they are):
    their exponents gathered into the scratch row ``x [C]`` (``C / B`` blocks at a time; ``frac,
    scale [C]`` FP64) and taken in one vectorised pass, as :func:`_row_state` takes a whole
    row's (block by block, each block's 16 exponentials cost about as much as a row's; the same
    operations on each weight, so the same bits)."""
    n, bsz = s.shape
    per = x.shape[0] // bsz
    b = 0
    while b < n:
        start, i = b, 0
        while b < n and i < per:
            if gate[b]:
                m[b] = _shifted(s[b], x[i * bsz:(i + 1) * bsz])
                i += 1
            b += 1
        _exp2(x[:i * bsz], x[:i * bsz], frac, scale)
        i = 0
        for c in range(start, b):
            if gate[c]:
                w[c] = x[i * bsz:(i + 1) * bsz]
                total[c], total2[c] = _sums(w[c])
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


@jit(fastmath={"reassoc", "contract"})
def _delta(q, bound, scaling):
    """``Delta_b = scaling sum_c |q_c| r_c`` (eq. 8) of one query ``q [d]`` and a block's
    channel bounds ``bound [d]``: a sum of non-negative terms in any order, as the reference's
    ``bmm`` (:func:`certkv.certify.bounds.block_deltas`)."""
    acc = _F32(0.0)
    for c in range(q.shape[0]):
        acc += abs(q[c]) * bound[c]
    return acc * scaling


def states_scratch(hq: int, n: int, bsz: int) -> np.ndarray:
    """:func:`_block_states`' scratch: each (head, range of blocks) task's FP64 exponent rows."""
    return np.empty((hq * PARTS, 2, (n // PARTS + 1) * bsz))


@jit(parallel=True)
def _block_states(group, s, q, bound, scaling, w, m, total, total2, log_mass, log_spread,
                  delta, scratch):
    """Phase 1 after its logits ``s [H, n, B]`` (``-inf`` on empty slots), for every query
    head ``h`` (kv head ``h // group``): the blocks' weights ``w [H, n, B]`` and softmax state
    ``m, total, total2 [H, n]`` (:func:`_row_state`), log-masses ``m + log(total)``,
    log-spreads ``m + log(total2) / 2`` and ``Delta_b`` from ``q [H, d]`` and the channel
    bounds ``bound [Hkv, n, d]`` (:func:`certkv.kernels.reference.phase1`). In parallel over
    (head, range of blocks): each block's numbers are its own, so two threads share out an odd
    number of heads evenly and every number is the same. ``scratch``: FP64
    (:func:`states_scratch`)."""
    hq, n = s.shape[0], s.shape[1]
    for task in prange(hq * PARTS):
        h, part = task // PARTS, task % PARTS
        lo, hi = part * n // PARTS, (part + 1) * n // PARTS
        frac, scale = scratch[task, 0], scratch[task, 1]
        _row_state(s[h, lo:hi], w[h, lo:hi], m[h, lo:hi], total[h, lo:hi], total2[h, lo:hi],
                   frac, scale)
        kv = h // group
        for b in range(lo, hi):
            log_mass[h, b] = m[h, b] + np.log(total[h, b])
            log_spread[h, b] = m[h, b] + _F32(0.5) * np.log(total2[h, b])
            delta[h, b] = _delta(q[h], bound[kv, b], scaling)


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
    total mass. ``scratch``: FP32 ``[4, m]`` and FP64 ``[2, m]``, ``m >= n`` (:func:`_attend`)."""
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
    top = _amax(m_b)
    for b in range(n):
        log_mass[h, b] = m_b[b] + np.log(l_b[b])
        alphas[b] = (m_b[b] - top) * _LOG2E
    _exp2(alphas, alphas, f64[0], f64[1])
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
    item 4 counts; a fused multiply-add rounds once where a product and a sum would twice)."""
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


def attend_scratch(hq: int, n: int, bsz: int) -> tuple:
    """:func:`_attend`'s scratch: Phase 2's weights ``[H, n, B]`` and each head's FP32 ``[4,
    m]`` and FP64 ``[2, m]`` rows (:func:`_head_weights`), ``m = max(n, GATED_CHUNK B)``."""
    m = max(n, GATED_CHUNK * bsz)
    return np.empty((hq, n, bsz), _F32), np.empty((hq, 4, m), _F32), np.empty((hq, 2, m))


@jit(parallel=True)
def _attend(group, s8, s16, state, gate, delta_b, eps_guard, values, staged_kv, staged_blk,
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
    hq, n, bsz = s8.shape
    hkv, d = hq // group, out.shape[1]
    vslot = np.full((hkv, n), -1, np.int64)
    for i in range(staged_kv.shape[0]):
        vslot[staged_kv[i], staged_blk[i]] = staged_row[i]
    l8, delta_t, promoted, quantized, r = checks
    w, f32, f64 = work  # Phase 2's weights, each head's scratch
    alphas, total = np.empty((hq, n), _F32), np.empty(hq, _F32)
    for h in prange(hq):
        total[h] = _head_weights(h, s8, s16, state, gate, delta_b, eps_guard, rho, log_mass,
                                 spread, canary, w[h], alphas[h], (f32[h], f64[h]))
        if r >= 1:
            rank_checks(h, l8, log_mass, delta_t, promoted, quantized, r, flags[0], flags[1])
    chunks = (n + SUM_CHUNK - 1) // SUM_CHUNK
    parts = np.empty((hkv, chunks, group, d), _F32)
    o_b, blocks, wb = (np.empty((hkv * chunks, group, d), _F32),
                       np.empty((hkv * chunks, bsz, d), _F32),
                       np.empty((hkv * chunks, group, bsz), _F32))
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


@dataclass
class NumbaBackend(TorchBackend):
    """The reference with each phase as fused CPU loop nests (numba); the reference itself for
    FP64 softmax scalars, a store off the CPU, or where numba is missing."""

    name: str = "numba"

    def _fused(self, device: torch.device) -> bool:
        """Whether the loop nests run for tensors on ``device``."""
        return AVAILABLE and not self.fp64_scalars and device.type == "cpu"

    def fuses_step(self, device: torch.device) -> bool:
        """The default step runs as one numba call where the loop nests run
        (:mod:`certkv.kernels.numba_step`)."""
        return self._fused(device)

    def in_place(self, store) -> str:
        """Keys and values (``"kv"``) where the loop nests run: Phase 2 reads both kinds of
        FP16 originals from Tier-2 in place (on a CPU store the same memory a scratch cache
        would copy them into; the cache still counts them); else the reference's."""
        return "kv" if self._fused(store.device) else super().in_place(store)

    def dense_rows(self, q, heads, store, scaling):
        """Rungs 3-4 over the FP16 originals in place where the loop nests run
        (:mod:`~certkv.kernels.numba_dense`); else the caller's gather."""
        if self._fused(store.device) and numba_dense.covers(store, q):
            return numba_dense.dense_heads(q, heads, store, scaling)
        return None

    def decoded_mirror(self, device: torch.device) -> bool | str:
        """``"lean"`` where the loop nests run: they decode INT8 key codes (and 4-bit group
        value codes) and read the FP16 originals (Tier-2, the tail buffer) in place, so the
        mirror keeps the key bounds and slot bias, and the values of other value codecs
        (:func:`~certkv.cache.mirror.mirror_fields`)."""
        return "lean" if self._fused(device) else super().decoded_mirror(device)

    def phase1(self, q, lay, scaling) -> Scored:
        """Phase 1 (shapes as :func:`certkv.kernels.reference.phase1`): the logits from the
        INT8 key codes and the decoded mirror (:func:`~certkv.kernels.numba_logits.key_logits`;
        the reference's BLAS product on a store without a mirror), then every block's softmax
        state, log-mass, log-spread and ``Delta_b`` in one loop nest (:func:`_block_states`)."""
        if not self._fused(q.device):
            return super().phase1(q, lay, scaling)
        hkv, group, _ = q.shape
        hq, n, bsz = hkv * group, lay.num_blocks, lay.store.block_size
        codes = int8_keys(lay.store)
        if codes is None:  # no decoded mirror: the reference's BLAS product
            s8 = as_array(block_scores(q, lay.keys, lay.slot_bias, scaling).view(hq, n, bsz))
        else:
            s8 = key_logits(q, lay, scaling, codes)
        s = torch.from_numpy(s8).view(hkv, group, n, bsz)
        per_block, w = np.empty((6, hq, n), _F32), np.empty((hq, n, bsz), _F32)
        use_threads(torch.get_num_threads())
        _block_states(group, s8, as_array(q.reshape(hq, -1)), as_array(lay.key_bound),
                      _F32(scaling), w, *per_block, states_scratch(hq, n, bsz))
        m, total, total2, log_mass, log_spread, delta = torch.from_numpy(per_block).view(
            6, hkv, group, n).unbind()
        state = BlockSoftmax(m, torch.from_numpy(w).view(hkv, group, n, bsz), total, total2)
        return Scored(scores=s, log_mass=log_mass, delta_b=delta, log_spread=log_spread,
                      state=state, arrays=(s8, (per_block[0], w, *per_block[1:3]),
                                           codes is not None))

    def phase2(self, q, scored, lay, gate, staged, scaling, eps_guard,
               checks: CheckInputs | None = None) -> Attended:
        """Phase 2 in one loop nest (shapes as :meth:`TorchBackend.phase2`), the ranking and
        boundary checks (``checks``) in its epilogue. Where ``keys`` were asked for, the
        FP16-key logits of the blocks ``gate [Hkv, G, n]`` sets replace Phase 1's; they come
        from the kind of product Phase 1's came from (the canary compares like with like): its
        dot products over the gated blocks' originals
        (:func:`~certkv.kernels.numba_logits.gated_logits`), or the BLAS product over all."""
        if not self._fused(q.device):
            return super().phase2(q, scored, lay, gate, staged, scaling, eps_guard, checks)
        keys, values = staged
        hkv, group, n, bsz = scored.scores.shape
        hq, d = hkv * group, q.shape[-1]
        s8, state, dots = scored.arrays or _arrays(scored)
        if keys is None:
            s16, gate = s8, torch.zeros(hq, n, dtype=torch.bool)
        elif dots:  # Phase 1's dot products: the same loop over the FP16 originals
            s16 = gated_logits(q, lay, gate, scaling)
        else:  # Phase 1's BLAS product
            s16 = as_array(block_scores(q, lay.original_keys, lay.slot_bias, scaling).view(
                hq, n, bsz))
        out, per_block = np.empty((hq, d), _F32), np.empty((3, hq, n), _F32)
        canary, flags = np.empty((hq, n), np.bool_), np.ones((2, hq), np.bool_)
        use_threads(torch.get_num_threads())
        _attend(group, s8, s16, state,
                as_array(gate.reshape(hq, n)), as_array(scored.delta_b.reshape(hq, n)),
                _F32(eps_guard), nv.sources(lay.store, lay), *_staged(values, lay.store),
                _check_args(checks, hq, n), out, *per_block, canary, flags,
                attend_scratch(hq, n, bsz))
        rho, log_mass, spread = torch.from_numpy(per_block).view(3, hkv, group, n).unbind()
        att = Attended(out=torch.from_numpy(out).view(hkv, group, d), rho=rho,
                       log_mass=log_mass, canary=torch.from_numpy(canary).view(hkv, group, n),
                       spread=spread)
        if checks is not None:
            att.ranking, att.boundary = torch.from_numpy(flags).unbind()
        return att


def _arrays(scored: Scored) -> tuple[np.ndarray, tuple, bool]:
    """NumPy views ``(s8 [H, n, B], (m, w, l, l2), False)`` of Phase-1 scores made elsewhere
    (the reference's, or masked by naive eviction; their logits a BLAS product): the softmax
    state recomputed in FP32 where it is missing or in FP64."""
    state, s = scored.state, scored.scores
    if state is None or state.w.dtype != torch.float32:
        state = block_softmax(s)
    hkv, group, n, bsz = s.shape
    return (as_array(s.reshape(-1, n, bsz)),
            tuple(as_array(x.reshape(hkv * group, n, *x.shape[3:])) for x in state), False)


def _staged(values, store) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Promoted FP16 value blocks as ``(kv heads [p], blocks [p], rows [p], pool [P, B, d])``:
    their rows in the pool they are read from in place, as int16 bits: Tier-2's originals
    (:meth:`in_place`: block ``b`` of kv head ``h`` at row ``h W + b``), or a pool staged by
    the caller (the scratch cache's buffer, or a staged copy)."""
    if values is None:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty, np.zeros((1, store.block_size, store.head_dim), np.int16)
    kv, blk = as_array(values.kv_heads.long()), as_array(values.blocks.long())
    if values.data is None:
        _, pool, width = store.original_rows()
        rows = kv * width + blk
    else:
        pool = values.data
        rows = as_array(torch.arange(pool.shape[0]) if values.rows is None
                        else values.rows.long())
    return kv, blk, rows, as_array(pool.view(torch.int16))


def _check_args(checks: CheckInputs | None, hq: int, n: int) -> tuple:
    """The epilogue's ``(l8, delta_b, promoted, quantized, r)``; ``r = 0`` for no checks."""
    if checks is None:
        none = np.zeros((hq, n), _F32)
        return none, none, np.zeros((hq, n), np.bool_), np.zeros(n, np.bool_), 0
    return (as_array(checks.l_int8.reshape(hq, n).float()),
            as_array(checks.delta_b.reshape(hq, n)), as_array(checks.promoted.reshape(hq, n)),
            as_array(checks.quantized), int(checks.r))
