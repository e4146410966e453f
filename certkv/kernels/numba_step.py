"""The CPU backend's certified step as one compiled call (issue 24: a few fused loops, not
hundreds of small operators).

The numba backend runs a certified step as six loop nests: Phase 1's logits and block states
in one (:mod:`~certkv.kernels.numba_logits`, :mod:`~certkv.kernels.numba_backend`), the
selection (:mod:`certkv.certify.fused_select`), Phase 2's FP16-key logits and its attention with
the checks in its epilogue, the certificate and the rungs (:mod:`certkv.certify.fused_cpu`).
Called one by one from Python, a SmolLM2 layer step spent about as long between them (NumPy
views of torch tensors, the phases' result objects, about 300 aten operators) as inside them.
:func:`run` hands them the step's arrays once and runs them in one compiled call
(:func:`_step`): the same kernels in the same order on the same inputs, so every number is the
phase-by-phase step's, bit for bit (``tests/kernels/test_numba_step.py`` compares them over decode
steps). What needs Python stays with the caller: the scratch cache's counters, the fallback
(rungs 3-4) and the certificate object.

:func:`covers` says which steps it runs: certified steps of the numba backend on a CPU store
with a decoded mirror, without protection, eviction, exploration or a bound tolerance, with the
default selection (:func:`certkv.certify.fused_select.covers`), a query in FP16, BF16 or FP32
and no phase timer (a :class:`~certkv.timing.PhaseTimer` times the phases one call each).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import NamedTuple

import numpy as np
import torch

from certkv.certify import fused_cpu, fused_select
from certkv.certify.certificate import BlockStats
from certkv.certify.fused_cpu import as_array, jit, kept_array, kept_bits, use_threads
from certkv.certify.segment import CertifyOutputs
from certkv.certify.step_certify import StepPass
from certkv.kernels import numba_attend as na
from certkv.kernels import numba_backend as nb
from certkv.kernels import numba_logits as nl
from certkv.kernels import numba_values as nv
from certkv.kernels.layout import StepLayout

_F32 = np.float32
QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # exact in FP32 and FP64


def covers(attention, q: torch.Tensor, store, on_device: bool, tolerant: bool) -> bool:
    """Whether :func:`run` computes this step of ``attention`` (see the module)."""
    backend = attention.backend
    return (not tolerant and attention.ladder.exploration <= 0  # no draw, no escalation
            and attention._fused_select(q.device, None, None, on_device)
            and backend.fuses_step(q.device)
            and q.dtype in QUERY_DTYPES and not getattr(attention.timer, "per_phase", False)
            and store.evicted_pid is None and not store.protection.enabled
            and store.has_decoded_mirror)  # what numba_logits.int8_keys reads


class Fused(NamedTuple):
    """What :func:`run` returns (CPU tensors; ``[Hq]`` unless noted), named as in
    :func:`certkv.certify.step_certify.certify_step`."""

    out: torch.Tensor  # [Hq, d] FP32, before the fallback
    e_key: torch.Tensor
    e_val: torch.Tensor
    e_arith: torch.Tensor
    tail_mass: torch.Tensor
    paper_key: torch.Tensor
    paper_val: torch.Tensor
    k_star: torch.Tensor
    value_blocks: torch.Tensor
    delta: torch.Tensor
    v_rad: torch.Tensor
    rung: torch.Tensor
    ranking: torch.Tensor
    boundary: torch.Tensor
    canary: torch.Tensor
    flags: torch.Tensor  # [Hq + 2]
    returned: tuple  # E_key, E_val as returned (0 on rungs 3-4)
    rho: torch.Tensor  # [Hq, n] Phase 2's block masses
    delta_b: torch.Tensor  # [Hq, n] tightened
    plan: torch.Tensor  # [2, Hkv, n] FP16 keys, FP16 values wanted
    counts: tuple  # (heads flagged dense, q non-finite, K/V non-finite, FP16 key blocks,
    # FP16 value blocks): what the caller's host bookkeeping branches on, read in one call

    def step_pass(self, arrays: StoreArrays, spec) -> StepPass:
        """The pass as :class:`~certkv.certify.step_certify.StepPass`, which the fallback and
        the certificate read (``arrays``: the store's, :func:`store_arrays`; ``spec``: its
        :class:`~certkv.certify.arith.ArithSpec`)."""
        cert = CertifyOutputs(self.e_key, self.e_val, self.e_arith, self.tail_mass, self.k_star,
                              self.canary, self.rung, self.value_blocks, self.flags,
                              self.paper_key, self.paper_val, self.returned, None)
        blocks = BlockStats(self.rho, arrays.eta, self.delta_b, self.v_rad, arrays.quantized)
        return StepPass(self.out, spec, cert, self.delta, self.ranking, self.boundary, blocks,
                        arrays.num_quantized, self.counts[4])


class StoreArrays(NamedTuple):
    """What :func:`_step` reads of a store, as NumPy arrays of the tensors it keeps, with the
    layout facts the step's result needs (:func:`store_arrays`). While :attr:`key` holds, the
    arrays the store writes between steps (the tail's tokens, the running maxima, the mirror's
    slot bias and rows) view its memory and the others (codes, annotations, Tier-2 rows) do not
    change, so one set serves every step until a block completes or a buffer grows; the tail's
    fill, the query and the step's coefficients are read at each step."""

    key: tuple | None  # (graph signature, completed blocks, tail present); None: never kept
    num_blocks: int  # n, the tail block included
    num_quantized: int
    eta: torch.Tensor  # [Hkv, n] (the certificate's block statistics)
    quantized: torch.Tensor  # [n]
    keys: tuple  # Phase 1's key sources but the tail's fill (:func:`_step`'s ``keys[:-1]``)
    bias: np.ndarray  # [n, B]
    bound: np.ndarray  # [Hkv, n, d]
    mask: np.ndarray  # [n] quantized
    per_kv: tuple  # eta, value_spec, key_err, key_spec [Hkv, n]
    v_max: np.ndarray  # [Hkv]
    v_rad: np.ndarray  # [Hkv]
    originals: tuple  # FP16 original keys' bits, row width, completed blocks
    values: tuple  # value sources (numba_values.sources)
    pool: np.ndarray  # FP16 original values' bits [R, B, d]
    width: int
    key_abs_max: np.ndarray  # [Hkv, d]
    eta_max: np.ndarray  # [Hkv]
    specs: dict  # (backend, query dtype, scaling, mass inflation) -> ArithSpec (the caller's)


_ARRAYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # store -> StoreArrays


class _ThreadScratch(threading.local):
    """A thread's scratch sets (:func:`scratch`): ``kept`` shape -> arrays, least recently
    used first; ``used`` shape -> the call that last used it; ``calls`` so far."""

    def __init__(self) -> None:
        self.kept: dict = {}
        self.used: dict = {}
        self.calls = 0


_SCRATCH = _ThreadScratch()
SCRATCH_SHAPES = 8  # a shape no call of the last 8 used is dropped (a batch's sequences take turns)


def scratch(hkv: int, group: int, n: int, bsz: int, d: int) -> tuple:
    """The scratch arrays :func:`_step` writes and reads within one call and never returns
    (``s8, w, s16 [Hq, n, B]`` FP32, then :func:`~certkv.kernels.numba_backend._phase1`'s,
    the selection's, :func:`~certkv.kernels.numba_attend.attend`'s, the certificate's and the
    step's own: the block states ``[4, Hq, n]``, the selection's FP32 ``[3, Hq, n]`` and bool
    ``[2, Hq, n]`` results, the certificate's block inputs ``[7, Hq, n]``, the gate and the
    canary ``[Hq, n]`` (bool), the per-kv-head inputs ``[3, Hkv, n]`` and the FP64 query
    ``[Hq, d]``): made once per shape and kept for this thread's steps of that shape, instead
    of 33 arrays, about 2 MB (a SmolLM2 layer at 4K), allocated and freed per layer step (each
    a walk of the C heap's bins between the model's own allocations). Every layer of a model
    shares one shape until a block completes; a CPU batch steps its sequences one by one, each
    with its own block count, so a shape stays while one of the last :data:`SCRATCH_SHAPES`
    calls used it (a batch of up to that many sequences keeps all of its shapes; a single
    sequence's shape before its last block completed goes a few calls later). Each step writes
    every element it later reads, so no step sees another's numbers
    (``tests/kernels/test_numba_step.py`` steps stores of two shapes in turn, the scratch
    poisoned between them)."""
    shape, kept, used = (hkv, group, n, bsz, d), _SCRATCH.kept, _SCRATCH.used
    _SCRATCH.calls += 1
    call = _SCRATCH.calls
    made = kept.pop(shape, None)
    if made is None:
        made = _scratch(*shape)
    kept[shape], used[shape] = made, call  # the most recently used last
    oldest = next(iter(kept))
    if call - used[oldest] > SCRATCH_SHAPES or len(kept) > SCRATCH_SHAPES:
        del kept[oldest], used[oldest]
    return made


def _scratch(hkv: int, group: int, n: int, bsz: int, d: int) -> tuple:
    """:func:`scratch`'s arrays for one shape, made anew."""
    hq = hkv * group
    phase1 = (nb.states_scratch(hq, n, bsz), *nl.logits_scratch(hkv, bsz, d, group))
    own = (np.empty((4, hq, n), _F32), np.empty((3, hq, n), _F32),
           np.empty((2, hq, n), np.bool_), np.empty((7, hq, n), _F32),
           np.empty((hq, n), np.bool_), np.empty((hq, n), np.bool_),
           np.empty((3, hkv, n), _F32), np.empty((hq, d)))
    return (*(np.empty((hq, n, bsz), _F32) for _ in range(3)), phase1,
            fused_select.select_scratch(hq, n), na.attend_scratch(hq, n, bsz, group, d),
            fused_cpu.lanes_scratch(hq, n), own)


def store_arrays(store) -> StoreArrays:
    """:class:`StoreArrays` of ``store`` for this step: the last step's while the store's
    buffers, completed blocks and tail presence are the same (its
    :meth:`~certkv.cache.views.StoreViews.graph_signature`, which a CUDA graph replays on for
    the same reason: every buffer a step reads in place stays where it is), else made from a
    new :class:`~certkv.kernels.layout.StepLayout`. A store without a signature (stages, a
    byte budget, eviction, protection, a tracker) or with a view that would be a copy is made
    again at every step."""
    signature = store.graph_signature()
    key = None if signature is None else (signature, store.num_blocks, store.tail_len > 0)
    kept_now = _ARRAYS.get(store)
    if key is not None and kept_now is not None and kept_now.key == key:
        return kept_now
    made = _store_arrays(store, StepLayout(store), key)
    if made.key is not None:
        _ARRAYS[store] = made
    return made


def _store_arrays(store, lay: StepLayout, key: tuple | None) -> StoreArrays:
    """:class:`StoreArrays` from the step layout ``lay``; ``key`` None unless every array the
    store writes within a key (the slot bias, the running maxima, the tail's bits, a mirror's
    rows) views its tensor's memory: a copy would be stale at the next step. The others (codes,
    annotations, Tier-2 rows) change only when a block completes."""
    n, d = lay.num_blocks, store.head_dim
    _, v16, width = store.original_rows() if store.num_blocks else (None, None, 0)
    pool = np.zeros((1, store.block_size, d), np.int16) if v16 is None else kept_bits(v16)
    other_keys, tail_bits = nl._other_keys(store), nl._tail(store)[0]
    keys = (*nl.int8_keys(store), *other_keys, tail_bits)
    arrays = StoreArrays(
        key, n, int(lay.num_quantized), lay.eta, lay.quantized, keys,
        as_array(lay.slot_bias.view(n, store.block_size)), kept_array(lay.key_bound),
        kept_array(lay.quantized),
        tuple(kept_array(x) for x in (lay.eta, lay.value_spec, lay.key_err, lay.key_spec)),
        as_array(lay.v_max), as_array(lay.v_radius),
        (*nl._original_keys(store), store.num_blocks), nv.sources(store, lay), pool, width,
        kept_array(store.key_abs_max()), kept_array(store.value_error_max()), {})
    mirror_keys, mirror_values = store.decoded_with_tail()
    tail_k, tail_v = store.tail_buffers()
    live = [(arrays.bias, lay.slot_bias), (arrays.v_max, lay.v_max),
            (arrays.v_rad, lay.v_radius), (arrays.key_abs_max, store.key_abs_max()),
            (arrays.eta_max, store.value_error_max()), (tail_bits, tail_k),
            (arrays.values[-1], tail_v)]  # numba_values.sources: the tail's bits last
    if mirror_keys is not None:  # numba_logits._other_keys: the mirror's rows first
        live.append((other_keys[0], mirror_keys))
    if mirror_values is not None:  # numba_values.sources: the mirror's values first
        live.append((arrays.values[0], mirror_values))
    if not all(_in_place(x, t) for x, t in live):
        arrays = arrays._replace(key=None)
    return arrays


def _in_place(x: np.ndarray, t: torch.Tensor) -> bool:
    """Whether ``x`` lies in ``t``'s memory (a view, not a copy)."""
    start, size = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    return start <= x.ctypes.data and x.ctypes.data + x.nbytes <= start + size


def run(attention, q: torch.Tensor, qg: torch.Tensor, store, arrays: StoreArrays,
        scaling: float, params: tuple) -> Fused:
    """One certified pass of ``attention`` (:func:`covers`) over ``store`` as ``arrays``
    (:func:`store_arrays`) hold it: ``q [Hq, d]`` in the caller's dtype, ``qg [Hkv, G, d]``
    its FP32 copy; ``params``: the certificate's scalars and weights at this step
    (:func:`certkv.certify.fused_cpu._params`)."""
    ladder, a = attention.ladder, arrays
    hkv, group, d = qg.shape
    hq = hkv * group
    checks = ladder.r if (ladder.ranking_check or ladder.boundary_check) else 0
    use_threads(torch.get_num_threads())
    res = _step(
        group, as_array(qg.reshape(hq, d)), _F32(scaling), (*a.keys, store.tail_len), a.bias,
        a.bound, a.mask, a.per_kv, a.v_max, a.v_rad,
        fused_select.params(attention.selector, ladder, attention.value_policy, scaling,
                            a.num_quantized), a.num_quantized, a.originals, a.values,
        a.pool, a.width, _F32(ladder.eps_guard), checks,
        (ladder.ranking_check, ladder.boundary_check), a.key_abs_max, a.eta_max,
        *params,
        (bool(store.nonfinite_appended()), fused_cpu.CAST_LIMIT.get(q.dtype, math.inf),
         ladder.canary, max(1.0, ladder.layer_dense_fraction * hq)),
        scratch(hkv, group, arrays.num_blocks, store.block_size, d))
    *arrays, counts = res
    out, kept, floats, ints, bools, flags, plan = (torch.from_numpy(x) for x in arrays)
    f, i, b = floats.unbind(), ints.unbind(), bools.unbind()  # every row is a field
    return Fused(out, *f[:6], i[0], i[1], f[6], f[7], i[2], *b, flags, f[8:], kept[0], kept[1],
                 plan, tuple(counts.tolist()))


@jit
def _step(group, q, scaling, keys, bias, bound, quantized, per_kv, v_max, v_rad, sel_params,
          n_q, originals, values, pool, width, eps_guard, r, wanted, key_abs_max, eta_max,
          par, weights, rung_par, work):
    """Phase 1, the selection, Phase 2 with its checks, the certificate and the rungs of a
    certified step in one call (:func:`run`; each kernel's docstring gives its shapes).

    ``q [Hq, d]`` FP32 (head ``h`` reads kv head ``h // group``); ``keys``: Phase 1's key
    sources (:func:`numba_logits.logits_range`); ``bias [n, B]``;
    ``bound [Hkv, n, d]``; ``quantized [n]``; ``per_kv``: ``eta, value_spec, key_err,
    key_spec``, ``[Hkv, n]`` each; ``v_max, v_rad [Hkv]``; ``originals``: the FP16 original keys'
    bits ``[R, B, d]``, their row width and the completed block count; ``values``: the value
    sources (:func:`~certkv.kernels.numba_values.sources`); ``pool [R, B, d]`` the FP16
    original values' bits at row ``kv * width + b``; ``r`` the checks' top-``r`` (0: none),
    ``wanted`` (ranking, boundary);
    ``key_abs_max [Hkv, d]``, ``eta_max [Hkv]``; ``par, weights``: the certificate's scalars;
    ``rung_par``: (non-finite appended K/V, the output dtype's cast limit, the canary on,
    the layer-dense head count); ``work``: the step's scratch (:func:`scratch`). Returns ``out
    [Hq, d]``, ``kept [2, Hq, n]`` (Phase 2's block masses and the tightened ``Delta_b``,
    copied out of the certificate's block inputs in the scratch for the caller to keep), the
    per-head results packed by kind (``[10, Hq]`` FP32, ``[3, Hq]`` int64, ``[3, Hq]`` bool:
    :func:`run` unpacks them into :class:`Fused`), the flags ``[Hq + 2]``, the page-in plan
    and ``counts [5]`` (:attr:`Fused.counts`)."""
    hq, d = q.shape
    hkv = hq // group
    n = bias.shape[0]
    eta, value_spec, key_err, key_spec = per_kv
    tail, fill = keys[9], keys[10]  # the tail buffer's bits and fill (logits_range)
    orig, orig_width, completed = originals
    s8, w, s16_work, phase1_work, select_work, attend_work, lanes, own = work
    state, sel_f, sel_b, blocks, no_gate, canary, per_kv_3, q64 = own
    # Phase 1: INT8 logits, block softmax states, log-masses, log-spreads, Delta_b (eq. 8)
    # the certificate's block inputs: l8, l16, rho, spread, log_p, delta_b, delta_chan
    nb._phase1(group, q, keys, bias, bound, scaling, s8,
               (w, state[0], state[1], state[2], blocks[0], state[3], blocks[6]), phase1_work)
    # selection, rung 1 and value promotion (rung 2)
    q_norm, expanded = np.empty(hq, _F32), np.empty(hq, np.bool_)
    plan, radii, exact = (np.empty((2, hkv, n), np.bool_), np.empty((2, hq), _F32),
                          np.empty(n, np.bool_))
    fused_select._kernel(blocks[0], blocks[6], state[3], q, quantized, eta, value_spec, key_err,
                         v_max, v_rad, sel_params, n_q, group, sel_f, sel_b, q_norm, expanded,
                         plan, radii, exact, select_work)
    blocks[4], blocks[5] = sel_f[0], sel_f[1]
    promoted = sel_b[0]
    # Phase 2: the promoted blocks' FP16-key logits (where any key block is paged in), the
    # promoted FP16 values read from Tier-2 in place, the checks (eq. 17-18) in its epilogue
    if plan[0].any():
        gate, s16 = promoted, s16_work
        nl._gated_logits(group, q, gate.reshape(hkv, group, n), orig, orig_width, completed,
                         tail, fill, bias, scaling, s16, phase1_work[1:])
    else:
        gate, s16 = no_gate, s8
        gate[:] = False
    staged = np.argwhere(plan[1])
    out = np.empty((hq, d), _F32)
    # the per-head results, packed so that run() views them in a few operators: floats
    # (the certificate's six terms, delta, v_rad, E_key and E_val as returned), ints (k_star,
    # value_blocks, rung), bools (ranking, boundary, canary_ok)
    floats, ints = np.empty((10, hq), _F32), np.empty((3, hq), np.int64)
    bools = np.ones((3, hq), np.bool_)
    ranked = bools[:2]
    na.attend(group, s8, s16, (state[0], w, state[1], state[2]), gate, blocks[6], eps_guard,
              values, staged[:, 0].copy(), staged[:, 1].copy(),
              staged[:, 0] * width + staged[:, 1], pool,
              (blocks[0], blocks[5], promoted, quantized, r), out, blocks[2], blocks[1],
              blocks[3], canary, ranked, attend_work)
    for i in range(2):
        if not wanted[i]:
            ranked[i] = True
    # the certificate (eq. 15, Cor. 4.2, E_arith) and the rungs
    per_head = np.empty((4, hq), _F32)
    per_head[0], per_head[1], per_head[2], per_head[3] = sel_f[2, :, 0], radii[0], radii[1], \
        q_norm
    q64[:] = q
    per_kv_3[0], per_kv_3[1], per_kv_3[2] = eta, value_spec, key_spec
    res_f, res_i = fused_cpu._kernel(blocks, per_head, per_kv_3, promoted, exact, plan[1], q64,
                                     key_abs_max, eta_max, out, par, weights, lanes)
    floats[:6], floats[6], floats[7], ints[:2] = res_f, per_head[0], per_head[2], res_i
    kv_bad, limit, use_canary, least = rung_par
    flags = np.empty(hq + 2, np.bool_)
    fused_cpu._rungs(floats[0], floats[1], floats[2], ints[1], out, q64, expanded, ranked[0],
                     ranked[1], canary, kv_bad, limit, True, use_canary, least, bools[2],
                     ints[2], flags, floats[8:])
    counts = np.array([flags[:hq].sum(), flags[hq], flags[hq + 1], plan[0].sum(),
                       plan[1].sum()], np.int64)
    kept = np.empty((2, hq, n), _F32)
    kept[0], kept[1] = blocks[2], blocks[5]
    return out, kept, floats, ints, bools, flags, plan, counts
