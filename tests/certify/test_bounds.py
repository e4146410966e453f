"""Appendix A and Section 4, numerically: Lemma A.2 (tight), Lemma A.3, Theorem 4.4, eq. 15."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certkv.certify.bounds import (
    block_deltas,
    block_tv_bound,
    centred_radius,
    key_error_bound,
    phase2_tail_mass_bound,
    spectral_norm_upper,
    tail_mass_bound,
    total_variation,
    value_block_terms,
    value_error_bound,
    value_error_bound_tight,
)


def perturbed(seed, n, delta, flat):
    gen = torch.Generator().manual_seed(seed)
    s = torch.zeros(n, dtype=torch.float64) if flat else torch.randn(n, generator=gen,
                                                                       dtype=torch.float64) * 4
    shift = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * delta
    signs = torch.sign(torch.randn(n, generator=gen, dtype=torch.float64))
    extreme = signs * delta  # vertices of the feasible box: the worst case
    return s, s + shift, s + extreme


@given(seed=st.integers(0, 10_000), n=st.integers(1, 300),
       delta=st.sampled_from([1e-4, 0.01, 0.18, 1.0, 3.0]), flat=st.booleans())
def test_lemma_a2_full_sequence_tv(seed, n, delta, flat):
    """TV <= tanh(Delta) (Lemma A.2), and in fact <= tanh(Delta / 2), which E_key uses."""
    s, s_rand, s_ext = perturbed(seed, n, delta, flat)
    a = torch.softmax(s, 0)
    for s2 in (s_rand, s_ext):
        tv = float(total_variation(a, torch.softmax(s2, 0)))
        assert tv <= math.tanh(delta / 2) + 1e-12 <= math.tanh(delta) + 1e-12


def test_worst_logit_shift_attains_tanh_half_delta():
    """Shifting a set of mass 1/(e^D + 1) up by D and the rest down by D gives TV = tanh(D/2):
    the sharp bound for logit perturbations. Lemma A.2's ratio-space vertex (TV = tanh D) is not
    reachable by logit shifts of at most D, so tanh D is valid but not tight."""
    delta = 0.7
    p = 1 / (math.exp(delta) + 1)
    a = torch.tensor([p, 1 - p], dtype=torch.float64)
    s2 = torch.log(a) + torch.tensor([delta, -delta], dtype=torch.float64)
    tv = float(total_variation(a, torch.softmax(s2, 0)))
    assert abs(tv - math.tanh(delta / 2)) < 1e-12
    assert tv < math.tanh(delta)


@given(seed=st.integers(0, 10_000), n=st.integers(2, 300), frac=st.floats(0.01, 0.99),
       delta=st.sampled_from([1e-3, 0.05, 0.18, 0.7, 2.0]))
def test_lemma_a3_tail_restricted_tv(seed, n, frac, delta):
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    tail = torch.rand(n, generator=gen) < frac
    shift = torch.sign(torch.randn(n, generator=gen, dtype=torch.float64)) * delta * tail
    a, a2 = torch.softmax(s, 0), torch.softmax(s + shift, 0)
    alpha_t = float(a[tail].sum())
    assert float(total_variation(a, a2)) <= alpha_t * math.expm1(2 * delta) + 1e-12


@given(seed=st.integers(0, 10_000), n=st.integers(2, 200),
       delta=st.sampled_from([1e-3, 0.18, 1.0]))
def test_theorem_4_4_tail_mass_ratio(seed, n, delta):
    """P(T) <= e^{2 Delta} P_hat(T) for any subset T (eq. 14)."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=gen, dtype=torch.float64) * 3
    s_hat = s + (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * delta
    subset = torch.rand(n, generator=gen) < 0.5
    true_mass = torch.softmax(s, 0)[subset].sum()
    est = torch.softmax(s_hat, 0)[subset].sum()
    assert true_mass <= math.exp(2 * delta) * est + 1e-12
    bound = tail_mass_bound(est.log().float().reshape(1), torch.tensor([delta]), 2.0)
    assert true_mass <= bound.double() * (1 + 1e-6)


def test_e_key_paper_operating_point():
    """Paper 4.3: tau_cov=0.995, Delta=0.18 -> E_key ~ 0.006 V_max (0.007 with e^{3 Delta})."""
    d = torch.tensor([0.18])
    alpha = torch.tensor([0.005]).log()
    tight = key_error_bound(torch.tensor([1.0]), d, d, alpha, 2.0)
    impl = key_error_bound(torch.tensor([1.0]), d, d, alpha, 3.0)
    assert abs(float(tight) - 2 * math.exp(0.36) * 0.005 * math.expm1(0.36)) < 1e-7
    assert round(float(tight), 3) == 0.006 and round(float(impl), 3) == 0.007


def test_e_key_edge_cases():
    one = torch.tensor([1.0])
    zero = torch.tensor([0.0])
    inf = torch.tensor([float("inf")])
    no_tail = torch.tensor([float("-inf")])
    assert float(key_error_bound(one, one, one, no_tail, 3.0)) == 0.0  # nothing on INT8 keys
    assert float(key_error_bound(one, inf, inf, zero, 3.0)) == 2.0  # saturates at 2 V_max
    assert float(key_error_bound(one, zero, zero, zero, 3.0)) == 0.0  # exact keys everywhere
    # the whole-sequence bound caps E_key when the tail is large
    assert float(key_error_bound(one, one, one, zero, 3.0)) == pytest.approx(2 * math.tanh(0.5))
    # an estimated tail mass that underflows FP32 still inflates to a valid bound (eq. 14)
    tiny = torch.tensor([-500.0])
    assert float(tail_mass_bound(tiny, torch.tensor([300.0]), 2.0)) == 1.0


def test_block_deltas_eq_8():
    q = torch.tensor([[[1.0, -2.0, 0.5]]])  # [Hkv=1, G=1, d=3]
    sigma = torch.tensor([[[0.2, 0.1, 0.4], [0.0, 0.0, 0.0]]])  # [Hkv, n=2, d]
    delta = block_deltas(q, sigma / 2, scaling=3**-0.5)
    expected = (1 * 0.2 + 2 * 0.1 + 0.5 * 0.4) / (2 * 3**0.5)
    torch.testing.assert_close(delta, torch.tensor([[[expected, 0.0]]]))
    # per-block form never exceeds the Cauchy-Schwarz form ||q|| ||sigma|| / (2 sqrt d)
    cs = q.norm() * sigma[0, 0].norm() / (2 * 3**0.5)
    assert delta[0, 0, 0] <= cs


def test_value_error_bound_corollary_4_2():
    rho = torch.tensor([[0.5, 0.3, 0.2]])
    eta = torch.tensor([[0.1, 0.0, 1.0]])
    torch.testing.assert_close(value_error_bound(rho, eta), torch.tensor([0.25]))


@given(seed=st.integers(0, 10_000), blocks=st.integers(2, 40),
       delta=st.sampled_from([1e-3, 0.05, 0.3, 2.0]), frac=st.floats(0.05, 0.95))
def test_phase2_tail_mass_bound_holds_and_beats_eq_14(seed, blocks, delta, frac):
    """alpha_T <= U_T / (Z_F + U_T) with exact promoted masses and INT8 tail masses inflated by
    their own Delta_b; it is never looser than eq. 14's e^{2 Delta} alpha_hat."""
    gen = torch.Generator().manual_seed(seed)
    bsz = 4
    s = torch.randn(1, blocks, bsz, generator=gen, dtype=torch.float64) * 3
    delta_b = delta * torch.rand(1, blocks, generator=gen, dtype=torch.float64)
    shift = (torch.rand(1, blocks, bsz, generator=gen, dtype=torch.float64) * 2 - 1)
    s8 = s + shift * delta_b.unsqueeze(-1)  # INT8 logits within Delta_b of the true ones
    tail = torch.rand(1, blocks, generator=gen) < frac
    promoted = ~tail
    l16, l8 = torch.logsumexp(s, -1), torch.logsumexp(s8, -1)
    true_tail = torch.softmax(l16, -1)[tail].sum()
    bound = phase2_tail_mass_bound(l8, l16, delta_b, promoted, tail)
    assert true_tail <= bound * (1 + 1e-9) + 1e-12
    # eq. 14 (tight exponent 2) with Delta = max over all blocks, alpha_hat from Phase 1
    alpha_hat = torch.softmax(l8, -1)[tail].sum()
    eq14 = min(1.0, math.exp(2 * float(delta_b.max())) * float(alpha_hat))
    assert float(bound) <= eq14 * (1 + 1e-9) + 1e-12


def blocks_case(seed, blocks, bsz, delta, frac, sign=None):
    """Exact logits ``s [blocks, bsz]``, perturbed ``s2`` with ``|s2 - s| <= D_b`` on the tail
    blocks (vertices of the box if ``sign`` is given) and 0 elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    s = torch.randn(blocks, bsz, generator=gen, dtype=torch.float64) * 3
    d_b = delta * torch.rand(blocks, generator=gen, dtype=torch.float64)
    tail = torch.rand(blocks, generator=gen) < frac
    d_b = d_b * tail
    if sign is None:
        y = (torch.rand(blocks, bsz, generator=gen, dtype=torch.float64) * 2 - 1)
    else:
        y = torch.full((blocks, bsz), float(sign), dtype=torch.float64)
    y = y * d_b.unsqueeze(-1)
    return s, s + y, d_b


def masses(s):
    p = torch.softmax(s.flatten(), 0).reshape(s.shape)
    return p, p.sum(-1), p.norm(dim=-1)


@given(seed=st.integers(0, 10_000), blocks=st.integers(1, 30), bsz=st.sampled_from([1, 4, 16]),
       delta=st.sampled_from([1e-4, 0.05, 0.3, 2.0, 30.0]), frac=st.floats(0.0, 1.0),
       sign=st.sampled_from([None, 1, -1]))
def test_block_tv_bound_holds(seed, blocks, bsz, delta, frac, sign):
    """TV(p, p') <= sum_b phi(D_b) min(rho'_b D_b, ||p'_b|| lambda_b) / W with the *perturbed*
    distribution's block masses, on random and extreme (box-vertex) perturbations."""
    s, s2, d_b = blocks_case(seed, blocks, bsz, delta, frac, sign)
    p, _, _ = masses(s)
    p2, rho2, spread2 = masses(s2)
    tv = float(total_variation(p.flatten(), p2.flatten()))
    lam = (s2 - s).norm(dim=-1)
    for bound in (block_tv_bound(rho2, d_b), block_tv_bound(rho2, d_b, lam, spread2)):
        assert tv <= float(bound) * (1 + 1e-9) + 1e-15


@pytest.mark.parametrize("delta", [1e-3, 1e-2])
def test_block_tv_bound_is_first_order_tight(delta):
    """One-signed small shifts on a small tail: the bound is TV (1 + O(delta + alpha_T)); the
    paper's a_T (e^{2 Delta} - 1) is about twice as large."""
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(20, 8, generator=gen, dtype=torch.float64)
    s[:18] += 6.0  # 18 heavy blocks, 2 light tail blocks
    d_b = torch.zeros(20, dtype=torch.float64)
    d_b[18:] = delta
    s2 = s + d_b.unsqueeze(-1)
    p, _, _ = masses(s)
    p2, rho2, _ = masses(s2)
    tv = float(total_variation(p.flatten(), p2.flatten()))
    bound = float(block_tv_bound(rho2, d_b))
    alpha = float(p[18:].sum())
    assert tv <= bound <= tv * (1 + 2 * delta + 2 * alpha)
    assert alpha * math.expm1(2 * delta) > 1.9 * bound


def test_block_tv_bound_edge_cases():
    rho = torch.tensor([0.5, 0.5])
    assert float(block_tv_bound(rho, torch.zeros(2))) == 0.0  # exact keys
    assert float(block_tv_bound(rho, torch.tensor([float("inf"), 0.0]))) == 1.0
    assert float(block_tv_bound(rho, torch.tensor([200.0, 0.0]))) == 1.0  # overflow: TV <= 1
    assert float(block_tv_bound(torch.tensor([0.0, 1.0]), torch.tensor([5.0, 0.0]))) == 0.0


@given(seed=st.integers(0, 10_000), rows=st.sampled_from([1, 3, 16]),
       cols=st.sampled_from([1, 8, 64]), rank_one=st.booleans())
def test_spectral_norm_upper_bounds_the_operator_norm(seed, rows, cols, rank_one):
    gen = torch.Generator().manual_seed(seed)
    e = torch.randn(2, 3, rows, cols, generator=gen, dtype=torch.float64)
    if rank_one:  # aligned errors: every row the same direction
        e = e[..., :1, :] * torch.rand(2, 3, rows, 1, generator=gen, dtype=torch.float64)
    exact = torch.linalg.matrix_norm(e, ord=2)
    upper = spectral_norm_upper(e)
    assert (upper * (1 + 1e-12) >= exact).all()  # FP64 rounding: the store inflates so
    assert (upper <= exact * (1 + 1e-6) + 1e-150).all()
    assert (upper <= e.square().sum(dim=(-2, -1)).sqrt() * (1 + 1e-15)).all()
    assert spectral_norm_upper(torch.zeros(2, 0, 4, 4)).shape == (2, 0)
    bad = e.clone()
    bad[0, 1, 0, 0] = float("nan")  # non-finite data (a deferred check on GPUs): +inf
    upper = spectral_norm_upper(bad)
    assert torch.isinf(upper[0, 1]) and torch.isfinite(upper[1]).all()


@given(seed=st.integers(0, 10_000), bsz=st.sampled_from([1, 4, 16]),
       aligned=st.booleans(), one_token=st.booleans())
def test_value_block_terms_bound_the_block_error(seed, bsz, aligned, one_token):
    """||sum_t p_t e_t|| <= min(rho eta, s ||p||_2): random errors, errors aligned within the
    block (the spectral form's worst case), attention on one token (the spread's worst case)."""
    gen = torch.Generator().manual_seed(seed)
    d = 16
    e = torch.randn(bsz, d, generator=gen, dtype=torch.float64)
    if aligned:
        e = e[:1].expand(bsz, d)
    p = torch.rand(bsz, generator=gen, dtype=torch.float64) * 0.3
    if one_token:
        p = torch.zeros_like(p)
        p[int(torch.randint(bsz, (1,), generator=gen))] = 0.7
    actual = float((p.unsqueeze(-1) * e).sum(0).norm())
    rho, spread = p.sum().reshape(1), p.norm().reshape(1)
    eta = e.norm(dim=-1).amax().reshape(1)
    sigma = spectral_norm_upper(e).reshape(1)
    bound = float(value_error_bound_tight(rho, eta, spread, sigma))
    assert actual <= bound * (1 + 1e-12)
    assert bound <= float(value_error_bound(rho, eta))
    if aligned:  # equal errors: the triangle inequality is exact, so is the bound
        assert bound <= actual * (1 + 1e-9)


def test_value_block_terms_spread_wins_on_spread_attention():
    gen = torch.Generator().manual_seed(1)
    e = torch.randn(16, 64, generator=gen, dtype=torch.float64)
    p = torch.full((16,), 1 / 16, dtype=torch.float64)
    sigma = spectral_norm_upper(e).reshape(1)
    tight = value_block_terms(p.sum().reshape(1), e.norm(dim=-1).amax().reshape(1),
                              p.norm().reshape(1), sigma)
    assert float(tight) < 0.5 * float(e.norm(dim=-1).amax())


@given(seed=st.integers(0, 10_000), offset=st.sampled_from([0.0, 10.0, 1e3]),
       delta=st.sampled_from([0.01, 0.5, 3.0]))
def test_centred_values_bound_the_key_term(seed, offset, delta):
    """||sum_t (p'_t - p_t) v_t|| <= 2 TV max_t ||v_t - c|| for a fixed c (here the channel
    midrange): a large common value offset no longer enters E_key."""
    gen = torch.Generator().manual_seed(seed)
    n, d = 64, 8
    s = torch.randn(n, generator=gen, dtype=torch.float64) * 2
    s2 = s + (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * delta
    v = torch.randn(n, d, generator=gen, dtype=torch.float64) + offset
    p, p2 = torch.softmax(s, 0), torch.softmax(s2, 0)
    actual = float(((p2 - p).unsqueeze(-1) * v).sum(0).norm())
    centre = (v.amax(0) + v.amin(0)) / 2
    radius = float(centred_radius(v, centre))
    tv = float(total_variation(p, p2))
    assert actual <= 2 * tv * radius * (1 + 1e-9) + 1e-15
    assert radius <= float(v.norm(dim=-1).amax()) or offset == 0.0
    bound = key_error_bound(torch.tensor([radius], dtype=torch.float64),
                            torch.tensor([delta]), torch.tensor([delta]),
                            torch.tensor([0.0]), 2.0, tv_cap=torch.tensor([tv]))
    assert float(bound) <= 2 * tv * radius * (1 + 1e-6)


def test_spectral_norm_upper_in_eigensolver_chunks_is_the_same(monkeypatch):
    """cuSOLVER's batched eigensolver fails beyond about 32K matrices (a 64K prompt at 8 kv
    heads): the bound solves them in chunks, with the same result as one batch."""
    from certkv.certify import bounds

    err = torch.randn(3, 40, 16, 32, dtype=torch.float64)
    whole = bounds.spectral_norm_upper(err)
    monkeypatch.setattr(bounds, "EIGH_BATCH", 7)
    assert torch.equal(bounds.spectral_norm_upper(err), whole)
