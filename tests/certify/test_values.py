"""Value policies (paper 3.4 rung 2, Corollary 4.2)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import make_kv, make_query
from hypothesis import given
from hypothesis import strategies as st

from certkv import CertifiedAttention, GreedyBudget, LocalThreshold, NoValuePromotion, TieredKVStore
from certkv.certify.values import fewest_covering, phase2_mass_factor
from certkv.errors import ConfigError


def test_local_threshold_is_per_block():
    log_p = torch.tensor([[0.5, 0.3, 0.2]]).log()
    eta = torch.tensor([[0.2, 0.1, 0.5]])
    mask = LocalThreshold(v_tol=0.05).select(log_p, eta, torch.zeros(1))
    assert mask.tolist() == [[True, False, True]]  # 0.10 > 0.05, 0.03 <= 0.05, 0.10 > 0.05


def fewest_by_search(terms: list[float], limit: float) -> int:
    """The fewest entries whose removal leaves the rest at most ``limit``, trying every set."""
    import itertools

    for size in range(len(terms) + 1):
        for chosen in itertools.combinations(range(len(terms)), size):
            if sum(t for i, t in enumerate(terms) if i not in chosen) <= limit:
                return size
    raise AssertionError("removing every entry leaves 0")


def test_fewest_covering_sets_are_the_fewest_that_leave_at_most_the_limit():
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        m = 1 + trial % 7
        terms = torch.rand(3, m, generator=gen, dtype=torch.float64) ** 3  # skewed
        terms[0, : m // 2] = terms[0, 0]  # ties
        terms[1, m // 2:] = 0.0  # zeros are never taken
        limit = float(torch.rand(1, generator=gen)) * float(terms.sum(dim=1).max())
        sets = fewest_covering(terms, torch.full((3,), limit, dtype=torch.float64))
        for h in range(3):
            assert float(terms[h][~sets[h]].sum()) <= limit  # what stays meets the limit
            assert int(sets[h].sum()) == fewest_by_search(terms[h].tolist(), limit)
            assert not sets[h][terms[h] == 0].any()


def test_greedy_budget_promotes_largest_contributions_first():
    log_p = torch.tensor([[0.5, 0.3, 0.2]]).log()
    eta = torch.tensor([[0.2, 0.1, 0.5]])  # contributions 0.10, 0.03, 0.10 (Delta = 0)
    assert GreedyBudget(0.05).select(log_p, eta, torch.zeros(1)).tolist() == [[True, False, True]]
    assert GreedyBudget(0.13).select(log_p, eta, torch.zeros(1)).sum() == 1
    assert not GreedyBudget(0.5).select(log_p, eta, torch.zeros(1)).any()
    assert not NoValuePromotion().select(log_p, eta, torch.zeros(1)).any()


@given(seed=st.integers(0, 1000), loose=st.sampled_from([0.0, 1.0, 30.0]))
def test_the_phase2_mass_factor_bounds_every_block_mass_and_token_weight(seed, loose):
    """``phase2_mass_factor`` against the test's own logits: Phase-1 logits of 12 blocks of 4
    tokens, Phase-2 logits each moved within its block's ``Delta'_b`` (0 on blocks whose logits
    Phase 2 reuses; one of those with a loose ``Delta_b`` up to 30 that Phase 2 never reads):
    every Phase-2 block mass and token weight is at most ``F_b`` times its Phase-1 one, the
    per-block factor never exceeds the head's ``e^{2 Delta}``, and the loose unread block
    leaves the factor of the others as if it had none."""
    gen = torch.Generator().manual_seed(seed)
    s1 = 3 * torch.randn(2, 12, 4, dtype=torch.float64, generator=gen)
    delta_b = torch.rand(2, 12, dtype=torch.float64, generator=gen)
    delta_b[:, 5] = loose  # a summary's loose bound
    read = torch.rand(2, 12, generator=gen) < 0.5
    read[:, 5] = False  # Phase 2 reuses its Phase-1 logits
    shift = torch.where(read, delta_b, torch.zeros_like(delta_b))
    moves = (2 * torch.rand(2, 12, 4, dtype=torch.float64, generator=gen) - 1) * shift[..., None]
    p1, p2 = (torch.softmax(x.reshape(2, -1), dim=-1).reshape(2, 12, 4) for x in (s1, s1 + moves))
    log_p_hat = p1.sum(-1).log()
    factor = phase2_mass_factor(log_p_hat, shift).exp()
    assert (p2.sum(-1) <= factor * p1.sum(-1) * (1 + 1e-12)).all()
    assert (p2 <= factor[..., None] * p1 * (1 + 1e-12)).all()
    head = phase2_mass_factor(log_p_hat, delta_b.amax(dim=-1)).exp()
    assert (factor <= head * (1 + 1e-12)).all()
    unread = shift.clone()
    unread[:, 5] = 0.0
    assert torch.equal(factor, phase2_mass_factor(log_p_hat, unread).exp())


def test_greedy_budget_is_not_made_to_promote_everything_by_a_block_phase2_does_not_read():
    """With the head's largest ``Delta`` (a loose evicted summary's, 20), every block's mass
    bound is 1 and the budget promotes every block with a value error; with each block's own
    shift (0 where Phase 2 reuses Phase 1's logits) it promotes what the masses ask."""
    log_p = torch.tensor([[0.4, 0.3, 0.2, 0.05, 0.05]]).log()
    eta = torch.full((1, 5), 0.1)
    policy = GreedyBudget(0.05)
    assert policy.select(log_p, eta, torch.tensor([20.0])).all()
    shift = torch.zeros(1, 5)  # no block's keys read in FP16: Phase 2 reuses every logit
    assert policy.select(log_p, eta, shift).tolist() == [[True, True, False, False, False]]


@given(seed=st.integers(0, 1000), budget=st.sampled_from([0.0, 0.01, 0.05, 0.2]),
       scale=st.sampled_from([0.3, 2.0, 10.0]))
def test_greedy_budget_bounds_the_achieved_e_val(seed, budget, scale):
    """The hard-budget policy guarantees E_val <= budget on every fast-path head (Cor. 4.2 with
    the Lemma A.1 upper bound on Phase-2 block masses)."""
    k, v = make_kv(2, 200, 32, seed=seed, heavy_tail=seed % 2 == 0)
    store = TieredKVStore(2, 32, block_size=8, value_group=8)
    store.append(k, v)
    q = make_query(k, 2, seed=seed, scale=scale, peaked=seed % 3 == 0)
    _, cert = CertifiedAttention(value_policy=GreedyBudget(budget))(q, store)
    fast = cert.rung < 3
    assert (cert.e_val[fast] <= budget * (1 + 1e-5) + 1e-7).all()


@pytest.mark.parametrize("policy", [lambda: LocalThreshold(-1), lambda: GreedyBudget(-0.1)])
def test_negative_tolerances_rejected(policy):
    with pytest.raises(ConfigError, match="must be >= 0"):
        policy()


def test_infinite_tolerance_never_promotes():
    log_p = torch.tensor([[0.9, 0.1]]).log()
    eta = torch.tensor([[1e6, 1e6]])
    assert not LocalThreshold(math.inf).select(log_p, eta, torch.zeros(1)).any()


def test_tight_contribution_uses_the_spread_and_never_exceeds_the_paper():
    """min(p eta, sigma ||p||_2): a block whose mass spreads over its tokens is not promoted
    under the tight rule though the paper's p_hat * eta promotes it; the tight set is a subset."""
    log_p = torch.tensor([[0.5, 0.3, 0.2]]).log()
    eta = torch.tensor([[0.2, 0.1, 0.5]])
    sigma = torch.tensor([[0.4, 0.2, 0.5]])  # spectral norms (<= sqrt(B) eta)
    log_spread = log_p - 0.5 * math.log(16)  # uniform over B = 16 tokens: ||p_b|| = p_b / 4
    args = (log_p, eta, torch.zeros(1))
    paper = LocalThreshold(0.05, contribution="paper").select(*args, log_spread, sigma)
    tight = LocalThreshold(0.05).select(*args, log_spread=log_spread, sigma=sigma)
    assert paper.tolist() == [[True, False, True]]
    assert tight.tolist() == [[False, False, False]]  # 0.05, 0.015, 0.025 <= 0.05
    assert torch.equal(LocalThreshold(0.05).select(*args), paper)  # no spreads: the paper's


@given(seed=st.integers(0, 1000), tol=st.sampled_from([0.0, 0.01, 0.05]),
       greedy=st.booleans())
def test_tight_promotes_a_subset_of_the_papers_local_and_no_more_greedy(seed, tol, greedy):
    """LocalThreshold: the tight set is a subset of the paper's; GreedyBudget (which spends a
    budget in another order) promotes no more blocks than the paper's."""
    gen = torch.Generator().manual_seed(seed)
    log_p = torch.log_softmax(3 * torch.randn(4, 30, generator=gen), dim=-1)
    log_spread = log_p - 0.5 * math.log(16) * torch.rand(4, 30, generator=gen)
    eta = torch.rand(4, 30, generator=gen)
    sigma = eta * (1 + 3 * torch.rand(4, 30, generator=gen))
    delta = 0.1 * torch.rand(4, generator=gen)
    make = GreedyBudget if greedy else LocalThreshold
    tight = make(tol).select(log_p, eta, delta, log_spread=log_spread, sigma=sigma)
    paper = make(tol, contribution="paper").select(log_p, eta, delta, log_spread=log_spread,
                                                   sigma=sigma)
    if not greedy:
        assert not (tight & ~paper).any()
    assert tight.sum() <= paper.sum()


@pytest.mark.parametrize("make", [LocalThreshold, GreedyBudget])
def test_bad_contribution_gives_one_clear_sentence(make):
    with pytest.raises(ConfigError, match="contribution='exact' is unknown; use 'tight' or "):
        make(0.05, contribution="exact")
