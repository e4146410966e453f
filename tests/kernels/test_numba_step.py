"""The numba backend's certified step as one compiled call (certkv.kernels.numba_step): the
phase-by-phase step's numbers bit for bit, only on the steps it covers, under the contract."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from helpers import examples, make_kv, make_query, same_values
from helpers.contract import build, check_contract, scenarios
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.ladder import Ladder
from certkv.certify.values import LocalThreshold
from certkv.errors import NonFiniteError
from certkv.kernels import numba_step
from certkv.quant import KVQuantizer
from certkv.quant.protect.protection import Protection
from certkv.timing import PhaseTimer


@pytest.fixture
def one_calls(monkeypatch):
    """A list that gains an entry per step :func:`numba_step.run` computes."""
    calls, run = [], numba_step.run

    def counted(*args, **kwargs):
        calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(numba_step, "run", counted)
    return calls


def decode_both(k, v, mirror, q_dtype=torch.float32, group=3, steps=20, quantizer=None,
                **attention):
    """Decode the last ``steps`` tokens of ``k, v`` on one store (``quantizer``, default sink
    and residual windows), each step by the one call and phase by phase (a
    :class:`PhaseTimer` asks for the phases), each with its own scratch cache; asserts the
    outputs and certificates equal bit for bit and returns the certificates and both
    caches."""
    hkv, n, d = k.shape
    quantizer = quantizer or KVQuantizer(sink=16, residual=32)
    store = TieredKVStore(hkv, d, quantizer=quantizer, decoded_mirror=mirror)
    store.append(k[:, :-steps], v[:, :-steps])
    fused, phased = CertifiedAttention(**attention), CertifiedAttention(**attention)
    phased.timer = PhaseTimer()
    caches, certs = (ScratchCache(4, 4), ScratchCache(4, 4)), []
    for t in range(n - steps, n):
        q = make_query(k[:, :t], group, seed=t, peaked=t % 3 > 0).to(q_dtype)
        (out, cert), (out_p, cert_p) = (attn(q, store, scratch=c)
                                        for attn, c in zip((fused, phased), caches, strict=True))
        assert torch.equal(out, out_p) and same_values(cert, cert_p), t
        certs.append(cert)
        store.append(k[:, t:t + 1], v[:, t:t + 1])
    return certs, caches


@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mirror", [True, "lean"])
def test_one_call_gives_the_phase_by_phase_steps(one_calls, mirror, q_dtype):
    """Decode steps that fill the tail, complete a block and age one out of the residual
    window: output, every certificate field and the scratch cache's counters as phase by
    phase, for a whole and a lean mirror and every query dtype it takes."""
    k, v = make_kv(2, 16 * 14 + 12, 32, seed=7, outlier_channels=2)
    certs, (cache, cache_p) = decode_both(k, v, mirror, q_dtype)
    assert len(one_calls) == 20  # every fused step, no phased one
    assert cache.stats == cache_p.stats and cache.stats.misses > 0
    assert sum(int(c.k_star.sum()) for c in certs) > 0  # FP16 keys were paged in


def test_steps_share_a_scratch_per_shape_and_carry_nothing_from_step_to_step(one_calls):
    """Two stores of one shape stepped in turn, as a model's layers are, and a third of another
    block count, as a CPU batch steps its sequences: the stores of a shape share this thread's
    scratch for it (:func:`numba_step.scratch`: the same arrays at every step), each shape keeps
    its own, and every step equals its phase-by-phase twin bit for bit, so nothing one step
    leaves in the scratch reaches the next, even with every scratch element overwritten with
    poison (NaN, True, 0) between steps; another thread gets arrays of its own."""
    kvs = [make_kv(3, 16 * blocks + 12, 64, seed=seed) for seed, blocks in ((4, 18), (5, 18),
                                                                            (6, 13))]
    stores = []
    for k, v in kvs:
        stores.append(TieredKVStore(3, 64, quantizer=KVQuantizer(sink=16, residual=32),
                                    decoded_mirror="lean"))
        stores[-1].append(k, v)
    fused, phased = CertifiedAttention(), CertifiedAttention()
    phased.timer = PhaseTimer()
    kept: dict = {}  # shape -> ids of the arrays its steps used
    for t in range(4):
        for i, (store, (k, _)) in enumerate(zip(stores, kvs, strict=True)):
            q = make_query(k, 3, seed=10 * t + i, peaked=t % 2 == 0)
            if t >= 2:
                for arrays in numba_step._SCRATCH.kept.values():
                    _poison(arrays)
            (out, cert), (out_p, cert_p) = fused(q, store), phased(q, store)
            assert torch.equal(out, out_p) and same_values(cert, cert_p), (t, i)
            shape = next(reversed(numba_step._SCRATCH.kept))  # this step's, the most recent
            kept.setdefault(shape, set()).add(id(numba_step._SCRATCH.kept[shape][0]))
    assert len(one_calls) == 12 and len(kept) == 2
    assert all(len(ids) == 1 for ids in kept.values())
    other = []
    thread = threading.Thread(target=lambda: other.append(numba_step.scratch(*shape)[0]))
    thread.start()
    thread.join()
    assert other[0] is not numba_step.scratch(*shape)[0]


def test_a_thread_keeps_the_scratch_of_the_shapes_its_last_calls_used():
    """A shape stays while one of the last :data:`numba_step.SCRATCH_SHAPES` calls used it,
    never more shapes than that, the least recently used dropped first: a shape used again is
    kept, one the calls since went past is made anew, and a single sequence's shape from before
    its last block completed is gone once the next calls all use the new one."""
    most = numba_step.SCRATCH_SHAPES
    shapes = [(1, 1, n, 4, 4) for n in range(1, most + 2)]
    first = [numba_step.scratch(*shape)[0] for shape in shapes[:-1]]
    assert numba_step.scratch(*shapes[0])[0] is first[0]  # used again: now the most recent
    numba_step.scratch(*shapes[-1])  # one shape too many: the least recently used goes
    assert len(numba_step._SCRATCH.kept) == most
    assert numba_step.scratch(*shapes[0])[0] is first[0]
    assert numba_step.scratch(*shapes[1])[0] is not first[1]
    for _ in range(2 * most):  # one sequence after a block completed: only its new shape
        numba_step.scratch(*shapes[-1])
    assert list(numba_step._SCRATCH.kept) == [shapes[-1]]


def _poison(arrays) -> None:
    """Every array in the nested tuple ``arrays`` filled with what a step must never read:
    NaN, True, 0 (a slot that names a real row)."""
    for x in arrays:
        if isinstance(x, tuple):
            _poison(x)
        else:
            x.fill(np.nan if x.dtype.kind == "f" else 0 if x.dtype.kind in "iu" else True)


@pytest.mark.parametrize("mirror", [True, "lean"])
def test_store_arrays_are_kept_until_a_block_completes_or_a_buffer_grows(one_calls, mirror,
                                                                         monkeypatch):
    """From a 5-token prompt, 100 decode steps (blocks complete, the buffers grow): each step
    over the arrays kept from an earlier one equals the phase-by-phase step made afresh, bit
    for bit, and the arrays are made once per store layout (completed blocks, tail present,
    buffer sizes), not once per step. Where an array would be a copy of the store's memory
    (a whole mirror's block-major keys as head rows) they are made at every step, as are
    those of a store with age windows (its blocks change precision as tokens arrive)."""
    made, real = [], numba_step._store_arrays

    def making(*args):
        arrays = real(*args)
        made.append(arrays.key)  # None: not kept
        return arrays

    monkeypatch.setattr(numba_step, "_store_arrays", making)
    k, v = make_kv(2, 105, 32, seed=11, outlier_channels=2)
    decode_both(k, v, mirror, steps=100, quantizer=KVQuantizer())
    assert len(one_calls) == 100
    kept = [key for key in made if key is not None]
    assert len(kept) == len(set(kept))  # each layout's arrays made once at most
    if mirror == "lean":  # every array a view of the store's memory: kept between steps
        assert None not in made and len(made) < 20
        assert len({key[0] for key in kept}) > 1  # a buffer grew: made again


@pytest.mark.parametrize("attention", [
    {"ladder": Ladder(ranking_check=False)},
    {"ladder": Ladder(boundary_check=False, r=3)},
    {"ladder": Ladder(ranking_check=False, boundary_check=False, canary=False)},
    {"ladder": Ladder(expand=False, layer_dense_fraction=0.2, eps_guard=0.0)},
    {"value_policy": LocalThreshold(v_tol=1e-4)},
    {"value_policy": LocalThreshold(v_tol=1e-4, contribution="paper"), "ladder": Ladder(r=2)},
], ids=["no_ranking", "no_boundary_r3", "no_checks", "layer_dense", "values", "paper_values"])
def test_one_call_follows_the_ladder_and_value_policy(one_calls, attention):
    """Checks on and off, wider ranking checks, layer-dense, FP16 value promotion: the one
    call's steps are the phase-by-phase ones, fallback heads included."""
    k, v = make_kv(3, 16 * 12 + 5, 64, seed=3, outlier_channels=3)
    certs, _ = decode_both(k, v, "lean", group=2, **attention)
    assert len(one_calls) == 20
    if "value_policy" in attention:
        assert sum(c.value_promotions for c in certs) > 0


def test_one_call_falls_back_to_dense_heads_like_the_phases(one_calls):
    """A step whose checks send heads to rungs 3-4 (a tiny canary margin and wide ranking
    check on near-tied blocks): the fallback writes the same dense heads either way."""
    k, v = make_kv(2, 16 * 10 + 7, 32, seed=5, outlier_channels=2, key_levels=1)
    certs, _ = decode_both(k, v, True, ladder=Ladder(r=3, eps_guard=0.0))
    assert len(one_calls) == 20
    assert any(bool((c.rung >= 3).any()) for c in certs)


def layer(mirror="lean", protect=False):
    k, v = make_kv(2, 100, 16, seed=1)
    quantizer = KVQuantizer(block_size=8, protection=Protection("hamming74")) if protect else None
    store = TieredKVStore(2, 16, block_size=8, decoded_mirror=mirror, quantizer=quantizer)
    store.append(k, v)
    return store, make_query(k, 2, seed=1)


@pytest.mark.parametrize("case", [
    "phase_timer", "exploration", "bound_tol", "no_mirror", "protected", "fp64_query",
    "fp64_scalars", "naive", "operators"])
def test_steps_outside_its_cover_run_phase_by_phase(one_calls, case):
    """Each thing the one call does not cover sends the step through the phases; the default
    step on a store with a mirror takes the one call."""
    from certkv.kernels.numba_backend import NumbaBackend

    store, q = layer(case != "no_mirror", case == "protected")
    attention = {"exploration": {"ladder": Ladder(exploration=0.3)},
                 "bound_tol": {"ladder": Ladder(bound_tol=1e-3)},
                 "fp64_scalars": {"backend": NumbaBackend(fp64_scalars=True)},
                 "naive": {"mode": "naive"}, "operators": {"compile": False}}.get(case, {})
    attn = CertifiedAttention(**attention)
    if case == "phase_timer":
        attn.timer = PhaseTimer()
    attn(q.double() if case == "fp64_query" else q, store)
    assert one_calls == []
    CertifiedAttention()(q, layer()[0])
    assert one_calls == [1]


def test_nonfinite_inputs_raise_from_the_one_call(one_calls, monkeypatch):
    """A NaN query raises; so do non-finite appended K/V that a store flags for the step (on a
    CPU its append raises at once; a device store defers the check to the step's flags)."""
    store, q = layer()
    q[1, 3] = float("nan")
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        CertifiedAttention()(q, store)
    store, q = layer()
    monkeypatch.setattr(store, "nonfinite_appended", lambda: torch.tensor(True))
    with pytest.raises(NonFiniteError, match="k or v"):
        CertifiedAttention()(q, store)
    assert len(one_calls) == 2


@st.composite
def covered(draw):
    """:func:`test_contract.scenarios` restricted to the steps the one call covers."""
    sc = draw(scenarios())
    return {**sc, "backend": "numba", "fused": True, "mode": "certified", "exploration": 0.0,
            "fp64_scalars": False, "union": False, "value_policy": "local",
            "tail_mass": "tight", "mirror": draw(st.sampled_from([True, "lean"])),
            "q_dtype": draw(st.sampled_from(["float32", "float16", "bfloat16"]))}


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(covered())
def test_contract_holds_on_the_one_call(sc):
    """The certificate contract against FP64 attention on every head, on steps the one call
    computes (adversarial data as the contract tests draw it)."""
    store, q, attn = build(sc)
    calls, run = [], numba_step.run
    numba_step.run = lambda *a: calls.append(1) or run(*a)
    try:
        check_contract(store, q, attn, sc["scaling"])
    finally:
        numba_step.run = run
    assert calls == [1]
