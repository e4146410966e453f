"""Selection as one fused CPU loop nest (:mod:`certkv.certify.fused_select`) against the
PyTorch operators it replaces (``CertifiedAttention._select_step``): the same log-masses,
``Delta_b`` and norms up to FP32 rounding, and the same key sets, rung-1 expansions and value
promotions except where a threshold falls within that rounding (the fused sums are FP64). The
contract (both against FP64 attention) is ``test_contract.py``'s."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import examples, make_kv, make_query
from helpers.contract import scenarios
from helpers.select import check_selections
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import AdaptiveTopK, CertifiedAttention, Ladder, TieredKVStore
from certkv.certify.values import GreedyBudget, LocalThreshold


@settings(max_examples=examples(150), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_fused_selection_matches_the_operators(sc):
    check_selections(sc)


def test_decisions_match_on_a_model_like_step():
    """Away from thresholds the two agree exactly, step after step."""
    k, v = make_kv(3, 900, 64, seed=5, outlier_channels=2)
    store = TieredKVStore(3, 64, block_size=16, decoded_mirror=True)
    store.append(k, v)
    for seed, peaked in ((1, False), (2, True), (3, True)):
        q = make_query(k, 3, seed=seed, scale=2.0, peaked=peaked)
        certs = []
        for compile_ in (False, None):  # the operators, then fused
            out, cert = CertifiedAttention(compile=compile_)(q, store)
            certs.append((out, cert))
        (out_o, cert_o), (out_f, cert_f) = certs
        for name in ("k_star", "rung", "value_blocks"):
            assert torch.equal(getattr(cert_o, name), getattr(cert_f, name)), name
        torch.testing.assert_close(out_f, out_o, rtol=1e-5, atol=1e-6)



SPECIAL = [0.0, -0.0, 1.0, -1.0, 0.5, 1e-45, -1e-45, 3.4e38, float("inf"), float("-inf"),
           float("nan")]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.one_of(st.sampled_from(SPECIAL), st.floats(width=32)), min_size=1,
                max_size=700),
       st.integers(0, 2**32 - 1))
def test_the_radix_ranking_is_the_stable_descending_sort_with_nan_first(values, bits_seed):
    """The selection's ranking (:func:`~certkv.certify.fused_select._descending`) puts blocks
    in exactly the order of ``torch.sort(descending=True, stable=True)`` with NaN first: ties
    (``0`` and ``-0`` among them), infinities, NaN and raw bit patterns (NaN payloads,
    subnormals) included, against a stable comparison sort of the same keys."""
    from certkv.certify.fused_select import _descending

    key = np.array(values, np.float32)
    raw = np.random.default_rng(bits_seed).integers(0, 2**32, key.size, dtype=np.uint32)
    key[::3] = raw[::3].view(np.float32)  # every third key: any 32 bits
    n = key.size
    expected = np.argsort(np.where(np.isnan(key), np.inf, key).astype(np.float64) * -1.0 + 0.0,
                          kind="stable")
    order = _descending(key, (np.empty(n, np.float32), np.empty((2, n), np.int64),
                              np.empty(256, np.int64)))
    assert np.array_equal(order, expected)
    torch_order = torch.sort(torch.from_numpy(np.where(np.isnan(key), np.inf, key)),
                             descending=True, stable=True).indices.numpy()
    assert np.array_equal(order, torch_order)

def test_blocks_forced_by_targeted_page_in_join_the_fused_selection_as_the_operators_add_them():
    """The blocks a tolerant step reads whole (``force``, :mod:`certkv.certify.targeted`) go
    into the key set after rung 1 and into the value plan where lossy: the fused selection with
    them equals the operators' (which it replaces on every such pass), decision for decision."""
    from certkv.certify import fused_select
    from certkv.certify.segment import SelectInputs
    from certkv.kernels.layout import StepLayout

    k, v = make_kv(3, 900, 64, seed=5, outlier_channels=2)
    store = TieredKVStore(3, 64, block_size=16, decoded_mirror=True)
    store.append(k, v)
    attn, lay = CertifiedAttention(), StepLayout(store)
    q = make_query(k, 3, seed=2, scale=2.0, peaked=True)
    qg = q.float().reshape(3, 3, 64)
    scored = attn.backend.phase1(qg, lay, 0.125)
    force = torch.rand(9, lay.num_blocks, generator=torch.Generator().manual_seed(0)) < 0.1
    inputs = SelectInputs(
        qg=qg, l8_kv=scored.log_mass, delta_kv=scored.delta_b,
        log_spread_kv=scored.log_spread, quantized=lay.quantized, eta=lay.eta,
        value_spec=lay.value_spec, key_err=lay.key_err, v_max_kv=lay.v_max,
        v_rad_kv=lay.v_radius, kv_of=attn._kv_of(9, 3, q.device), draw=None,
        n_q=lay.num_quantized, scaling=0.125, force=force)
    operators = attn._select_step(inputs)
    fused = fused_select.select(attn.selector, attn.ladder, attn.value_policy, inputs)
    unforced = fused_select.select(attn.selector, attn.ladder, attn.value_policy,
                                   inputs._replace(force=None))
    assert (fused.promoted & ~unforced.promoted).any()  # the force reads more than the set
    for name in ("promoted", "expanded", "value_kv", "plan", "exact"):
        assert torch.equal(getattr(fused, name), getattr(operators, name)), name
    assert attn._fused_select(torch.device("cpu"), None, None)


@pytest.mark.parametrize(("component", "value"), [
    ("selector", AdaptiveTopK(rank="upper")), ("selector", AdaptiveTopK(kv_group_union=True)),
    ("ladder", Ladder(tail_mass="paper")), ("ladder", Ladder(e_key_tol=0.1)),
    ("ladder", Ladder(exploration=0.1)), ("ladder", Ladder(bound_tol=0.1)),
    ("value_policy", GreedyBudget()),
])
def test_other_policies_run_the_operators(component, value):
    attn = CertifiedAttention(**{component: value})
    draw = attn.ladder.exploration_draw((1, 1), "cpu")
    boost = torch.zeros(1) if attn.ladder.bound_tolerance else None
    assert not attn._fused_select(torch.device("cpu"), draw, boost)


def test_the_default_policy_is_fused_on_cpu_unless_compile_is_false():
    cpu = torch.device("cpu")
    assert isinstance(CertifiedAttention().value_policy, LocalThreshold)
    assert CertifiedAttention()._fused_select(cpu, None, None)
    assert CertifiedAttention(value_policy=LocalThreshold(contribution="paper"))._fused_select(
        cpu, None, None)
    assert not CertifiedAttention(compile=False)._fused_select(cpu, None, None)
    assert not CertifiedAttention(mode="naive")._fused_select(cpu, None, None)
