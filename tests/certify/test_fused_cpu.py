"""The certificate as one fused CPU loop nest (:mod:`certkv.certify.fused_cpu`) against the
PyTorch operators it replaces: the same outputs, rungs and counts, and terms equal up to the
FP32 rounding of the operators' own evaluation. The contract itself (both evaluations against
FP64 attention) is ``test_contract.py``'s, whose scenarios draw either."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from helpers import examples, make_kv, make_query
from helpers.contract import ADVERSARIAL, build, scenarios
from helpers.select import check_selections, covered
from hypothesis import HealthCheck, assume, given, settings

import certkv.certify.fused_cpu as fused_cpu
from certkv import CertifiedAttention, TieredKVStore
from certkv.certify.step_certify import rungs
from certkv.errors import NonFiniteError

TERMS = ("e_key", "e_val", "tail_mass", "candidate_e_key", "candidate_e_val", "paper_e_key",
         "paper_e_val")
EXACT = ("rung", "k_star", "value_blocks", "ranking_ok", "boundary_ok", "canary_ok")


def both(sc):
    """One step of the scenario with the certificate as operators, then fused; and the
    largest logit magnitude (the operators' FP32 log-sum-exps err by a few of its ulps)."""
    results = []
    for fused in (False, True):
        store, q, attn = build({**sc, "fused": fused})
        results.append(attn(q, store, sc.get("scaling")))
    k, _ = store.dense_kv()
    scaling = sc.get("scaling") or q.shape[-1] ** -0.5
    group = q.shape[0] // k.shape[0]
    logits = torch.einsum("hd,htd->ht", q.double(), k.double().repeat_interleave(group, 0))
    return (*results, float(logits.abs().max()) * scaling)


def assert_same(operators, fused, logit_max=0.0):
    (out_o, cert_o), (out_f, cert_f) = operators, fused
    # The operators' FP32 log-sum-exps err by a few units of FP32 rounding u = 2^-24 of the
    # largest logit L, and the terms by that relative to themselves: measured over 400 draws
    # of these scenarios, at most 0.95 u max(10, L) (1.2e-4 relative at L = 3,960); 32 u L
    # leaves a factor 34 (was 1e-5 L: a 1% tolerance at L = 1,000).
    rtol = 32 * 2.0**-24 * max(10.0, logit_max)
    assert torch.equal(out_o, out_f)  # the same heads went dense
    for name in EXACT:
        assert torch.equal(getattr(cert_o, name), getattr(cert_f, name)), name
    for name in TERMS:  # FP64 here, FP32 log-sum-exps and sums there
        a, b = getattr(cert_o, name), getattr(cert_f, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        torch.testing.assert_close(b, a, rtol=rtol, atol=1e-30, equal_nan=True, msg=name)
    # e_arith = E_key+ + ... - e_key: the terms' own differences, relative to the whole bound
    bound = (cert_o.e_key + cert_o.e_val + cert_o.e_arith).double()
    finite = bound[bound.isfinite()]
    atol = 1e-30 + rtol * float(finite.max()) if finite.numel() else 1e-30
    torch.testing.assert_close(cert_f.e_arith, cert_o.e_arith, rtol=rtol, atol=atol,
                               equal_nan=True, msg="e_arith")


def test_numba_is_installed():
    """A dependency: without it every CPU step would quietly run the slow operators."""
    assert fused_cpu.AVAILABLE


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_the_fused_certificate_matches_the_operators(sc):
    if sc["mode"] == "dense":
        sc = {**sc, "mode": "certified"}
    # where the fused selection runs too, a threshold within FP32 rounding (e.g. tau_cov = 1
    # with one block holding all the mass) lets the two steps promote different blocks: both
    # certified, but not comparable here (test_fused_select checks that only ties differ)
    assume(not covered(sc) or check_selections(sc))
    assert_same(*both(sc))


@pytest.mark.parametrize("change", [
    {"q_scale": 1e3, "peaked": True, "q_dtype": "float16"},  # huge logits, 16-bit queries
    {"value_offset": 1e3, "q_dtype": "bfloat16"},  # huge values: FP16 / BF16 cast limits
    {"key_bits": 2, "q_scale": 30.0, "mode": "naive"},  # every block perturbed
    {"tokens": 3, "block": 16},  # only the exact tail block
    {"tokens": 160, "block": 1, "k_max": 0, "k_min": 0},  # one-token blocks, none promoted
])
def test_adversarial_steps_agree(change):
    assert_same(*both({**ADVERSARIAL, **change}))


def test_a_nan_query_goes_dense_the_same_way():
    results = []
    for compile in (False, None):
        k, v = make_kv(2, 200, 32, seed=4)
        store = TieredKVStore(2, 32, block_size=8)
        store.append(k, v)
        q = make_query(k, 2, seed=4)
        q[1, 3] = math.nan
        attn = CertifiedAttention(backend="torch", compile=compile, device_fallback=False)
        with pytest.raises(NonFiniteError, match="NaN"):
            attn(q, store)
        q[1] = 3e38  # finite, but its logits overflow FP32: a non-finite bound or output
        results.append(attn(q, store))
    assert_same(*results, logit_max=1e30)
    assert (results[1][1].rung[1] >= 3).item()


def test_cpu_steps_use_the_fused_certificate_unless_compile_is_set(monkeypatch):
    calls = []
    real = fused_cpu.certificate
    monkeypatch.setattr(fused_cpu, "certificate", lambda *a, **k: calls.append(1) or real(*a, **k))
    k, v = make_kv(1, 64, 16, seed=0)
    store = TieredKVStore(1, 16, block_size=8)
    store.append(k, v)
    q = make_query(k, 2, seed=0)
    CertifiedAttention()(q, store)
    assert len(calls) == 1
    CertifiedAttention(compile=False)(q, store)
    CertifiedAttention(compile="aot_eager")(q, store)
    assert len(calls) == 1


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("certified", [True, False])
def test_fused_rungs_match_the_operators_at_the_cast_limits(dtype, certified):
    """Rungs, canary, flags and returned bounds as :func:`certkv.certify.step_certify.rungs`, on
    outputs at the edge of the query dtype's range (FP16 65520, BF16 2^128 - 2^119), NaN / inf
    bounds, a canary violation and a non-finite query."""
    gen = torch.Generator().manual_seed(0)
    hq, d, n = 8, 4, 5
    limit = fused_cpu.CAST_LIMIT.get(dtype, 3e38)
    out = torch.randn(hq, d, generator=gen)
    out[0, 1] = limit * (1 - 2**-24)  # stays finite in the dtype
    out[1, 2] = limit  # overflows it (FP16 / BF16)
    out[2, 0] = float("nan")
    e_key, e_val, e_arith = torch.rand(3, hq, generator=gen)
    e_arith[3] = float("inf")
    e_val[4] = float("nan")
    expanded = torch.rand(hq, generator=gen) < 0.5
    value_blocks = torch.randint(0, 3, (hq,), generator=gen)
    ranking, boundary = torch.rand(2, hq, generator=gen) < 0.8
    canary_blocks = torch.zeros(2, hq // 2, n, dtype=torch.bool)
    for q_bad, canary_bad in ((False, False), (True, False), (False, True)):
        q = torch.randn(hq, d, generator=gen).to(dtype)
        if q_bad:
            q[5, 0] = float("inf")
        canary_blocks[1, 0, 3] = canary_bad
        attn = CertifiedAttention(mode="certified" if certified else "naive")
        kv_bad = torch.tensor(q_bad)
        x = SimpleNamespace(out=out, q=q, kv_bad=kv_bad, expanded=expanded, ranking=ranking,
                            boundary=boundary, canary_blocks=canary_blocks)
        want = rungs(attn, x, e_key + e_val + e_arith, value_blocks)
        got = fused_cpu.rungs((e_key, e_val, e_arith), value_blocks, out, q, fused_cpu.RungInputs(
            attn.ladder, certified, expanded, ranking, boundary, canary_blocks, kv_bad))
        for w, g in zip(want, got[:3], strict=True):
            assert torch.equal(w, g)
        fast = want[1] < 3
        for w, g in zip((e_key, e_val), got[3], strict=True):
            assert torch.equal(torch.where(fast, w, 0.0), g)


def test_kept_views_follow_their_tensor():
    """A NumPy view of a tensor a store keeps is made once and shows writes into it; a strided
    tensor is copied every call; an entry goes with its tensor."""
    import gc

    x = torch.zeros(3, 4)
    view = fused_cpu.kept_array(x)
    assert fused_cpu.kept_array(x) is view
    x[1, 2] = 5.0
    assert view[1, 2] == 5.0
    strided = x.t()
    assert fused_cpu.kept_array(strided) is not fused_cpu.kept_array(strided)
    held = len(fused_cpu._KEPT)
    del x, strided
    gc.collect()
    assert len(fused_cpu._KEPT) == held - 1 and view[1, 2] == 5.0


def _tv_every_block(rho, d, lam, spread) -> float:
    """:func:`fused_cpu._tv_block` as it was, every block through both ``expm1``: the same
    sequential FP64 sums in Python floats (libm's ``expm1``, as numba's)."""
    num, kept, top = 0.0, 0.0, -math.inf
    for r, db, la, sp in zip(rho, d, lam, spread, strict=True):
        dc = db if db != db else min(max(db, fused_cpu._F64_TINY), fused_cpu._F64_MAX)
        phi = math.expm1(dc) / dc
        per = math.nan if (r * db != r * db or sp * la != sp * la) else min(r * db, sp * la)
        if per > 0:
            num += phi * per
        kept += r * math.expm1(-db)
        top = math.nan if (top != top or db != db) else max(top, db)
    den = 1.0 + kept
    den = math.nan if (den != den or top != top) else max(den, math.exp(-top))
    tv = num / (den if den != den else max(den, fused_cpu._F64_TINY))
    return 1.0 if tv != tv else min(tv, 1.0)


@pytest.mark.parametrize("seed", range(6))
def test_exact_blocks_skip_the_tv_bound_s_transcendentals_with_the_same_bits(seed):
    """A block read exactly (``D_b = +-0``) skips both ``expm1`` of the per-block TV bound
    and changes no bit of it: mixed with quantized blocks, massless, NaN and infinite masses
    and spreads on the exact ones, a NaN ``D_b``, all blocks exact."""
    import numpy as np

    rng = np.random.default_rng(seed)  # D_b up to 0.3: bounds below TV's cap of 1
    n = 40
    rho, lam, spread = rng.random(n) / n, rng.random(n) * 3, rng.random(n) * 0.2
    d = np.where(rng.random(n) < 0.6, 0.0, rng.random(n) * 0.3)
    d[rng.random(n) < 0.3] = -0.0
    exact = np.flatnonzero(d == 0)
    if seed == 1:
        rho[exact[:3]] = [math.nan, math.inf, 0.0]
        spread[exact[3:5]] = [math.nan, math.inf]
    if seed == 2:
        d[np.flatnonzero(d != 0)[0]] = math.nan
    if seed == 3:
        d[:] = 0.0
    got = fused_cpu._tv_block(n, rho, d, lam, spread)
    want = _tv_every_block(rho, d, lam, spread)
    assert np.float64(got).tobytes() == np.float64(want).tobytes(), (got, want)
    assert (want == 1.0) == (seed in (1, 2)), want  # below the cap unless NaN is involved
