"""CPU backend: the PyTorch reference's phases with their logits, per-block softmax, value
sums and checks as fused loop nests (numba) (issue 24).

The reference (:mod:`certkv.kernels.reference`) states the phases and the checks as about 130
small PyTorch operators per layer step; on a CPU each costs microseconds of dispatch. Here each
phase is a few parallel loop nests: in Phase 1 the logits from the INT8 key codes and the
decoded mirror (:mod:`certkv.kernels.numba_logits`; a store without a mirror keeps the BLAS
product), then the blocks' softmax state, log-masses, log-spreads and ``Delta_b``
(:func:`_block_states`); in Phase 2 the FP16-key logits of the gated blocks (the same dot
products over the originals), then the heads' softmax, value sums and checks in one loop nest
(:mod:`certkv.kernels.numba_attend`).

Every quantity takes the same FP32 operations as the reference, in an order its rounding
chain already allows (:meth:`TorchBackend.rounding`: ``B - 1`` additions inside a block, then
at most ``SUM_CHUNK + n / SUM_CHUNK`` over blocks; ``Delta_b`` and the logits' dot products in
any order), so the arithmetic bound is the reference's; the exponentials are
:func:`~certkv.kernels.numba_softmax.exp2`'s, within the 1 u of ``2^x`` that arith's
``EXP_ULPS`` more than allows. NaN follows PyTorch
(``amax`` propagates it; sorting puts it first). ``fp64_scalars`` runs the reference itself.
Covers every codec: blocks without INT8 key codes are read from the decoded mirror.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from certkv.certify.fused_cpu import AVAILABLE, as_array, jit, prange, use_threads
from certkv.kernels import numba_dense
from certkv.kernels import numba_values as nv
from certkv.kernels.numba_attend import attend, attend_scratch
from certkv.kernels.numba_logits import (
    PARTS,
    gated_logits,
    int8_keys,
    key_logits,
    logits_range,
    task_blocks,
)
from certkv.kernels.numba_softmax import row_state
from certkv.kernels.reference import (
    Attended,
    BlockSoftmax,
    CheckInputs,
    Scored,
    TorchBackend,
    block_scores,
    block_softmax,
)

_F32 = np.float32


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


@jit
def _states_range(h, blocks, s, q, bound, scaling, states, scratch):
    """Phase 1 after its logits ``s [H, n, B]`` (``-inf`` on empty slots) for query head ``h``
    (of kv head ``kv``) over its blocks ``lo <= b < hi`` (``blocks = (kv, lo, hi)``): their
    weights and softmax state (:func:`row_state`) into ``states = (w [H, n, B], m, total,
    total2, log_mass, log_spread, delta [H, n])``, log-masses ``m + log(total)``, log-spreads
    ``m + log(total2) / 2`` and ``Delta_b`` from ``q [H, d]`` and the channel bounds ``bound
    [Hkv, n, d]`` (:func:`certkv.kernels.reference.phase1`). Each block's numbers are its own,
    so any split of the blocks gives the same numbers. ``scratch``: FP64 ``[2, >= (hi - lo)
    B]``."""
    w, m, total, total2, log_mass, log_spread, delta = states
    kv, lo, hi = blocks
    row_state(s[h, lo:hi], w[h, lo:hi], m[h, lo:hi], total[h, lo:hi], total2[h, lo:hi],
              scratch[0], scratch[1])
    for b in range(lo, hi):
        log_mass[h, b] = m[h, b] + np.log(total[h, b])
        log_spread[h, b] = m[h, b] + _F32(0.5) * np.log(total2[h, b])
        delta[h, b] = _delta(q[h], bound[kv, b], scaling)


@jit(parallel=True)
def _block_states(group, s, q, bound, scaling, states, scratch):
    """:func:`_states_range` for every query head ``h`` (kv head ``h // group``) over all
    blocks, in parallel over (head, range of blocks), so that two threads share out an odd
    number of heads evenly. ``scratch``: FP64 (:func:`states_scratch`)."""
    hq, n = s.shape[0], s.shape[1]
    for task in prange(hq * PARTS):
        h, lo, hi = task_blocks(task, n)
        _states_range(h, (h // group, lo, hi), s, q, bound, scaling, states, scratch[task])


@jit(parallel=True)
def _phase1(group, q, keys, bias, bound, scaling, s, states, work):
    """Phase 1 of a certified step in one parallel loop: for each (kv head, range of blocks)
    the logits ``s [H, n, B]`` of its query heads (:func:`logits_range`: ``keys`` its key
    sources, ``bias [n, B]`` the slot bias), then, while they are in cache, each of those
    heads' block states over the same range (:func:`_states_range`; ``states`` as there,
    ``bound [Hkv, n, d]``; ``work``: :func:`states_scratch`'s rows and
    :func:`~certkv.kernels.numba_logits.logits_scratch`'s two arrays). The same ranges as
    :func:`~certkv.kernels.numba_logits._key_logits` and :func:`_block_states`, so the same
    numbers as the two in turn, with one fork and join fewer."""
    n = bias.shape[0]
    hkv = q.shape[0] // group
    scratch, keys_work, dots_work = work
    for task in prange(hkv * PARTS):
        blocks = task_blocks(task, n)
        logits_range(group, q, keys, blocks, bias, scaling, (keys_work[task], dots_work[task]),
                     s)
        kv, part = blocks[0], task % PARTS
        for h in range(kv * group, (kv + 1) * group):  # _block_states' task of h, this range
            _states_range(h, blocks, s, q, bound, scaling, states, scratch[h * PARTS + part])


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
                      _F32(scaling), (w, *per_block), states_scratch(hq, n, bsz))
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
        attend(group, s8, s16, state,
                as_array(gate.reshape(hq, n)), as_array(scored.delta_b.reshape(hq, n)),
                _F32(eps_guard), nv.sources(lay.store, lay), *_staged(values, lay.store),
                _check_args(checks, hq, n), out, *per_block, canary, flags,
                attend_scratch(hq, n, bsz, group, d))
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
