"""Appendix A and Section 4, numerically: Lemma A.2 (tight), Lemma A.3, Theorem 4.4, eq. 15."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certkv.certify.bounds import (
    block_deltas,
    key_error_bound,
    phase2_tail_mass_bound,
    tail_mass_bound,
    total_variation,
    value_error_bound,
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
