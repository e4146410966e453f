"""Adaptive top-K* selector (paper 3.3): coverage reached or K_max hit, clamps, union."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from certkv import AdaptiveTopK
from certkv.certify.select import rank_blocks, union_by_kv_group
from certkv.errors import ConfigError


def masses(seed, hq, n, peaked):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(hq, n, generator=gen) * (6.0 if peaked else 0.5)
    return torch.softmax(logits, dim=-1)


@given(seed=st.integers(0, 10_000), n=st.integers(1, 64), tau=st.sampled_from([0.0, 0.5, 0.9,
       0.995, 1.0]), k_min=st.integers(0, 3), k_max=st.integers(0, 40), peaked=st.booleans(),
       has_tail=st.booleans())
def test_coverage_reached_or_k_max_hit(seed, n, tau, k_min, k_max, peaked, has_tail):
    k_min = min(k_min, k_max)
    p = masses(seed, 3, n, peaked)
    quantized = torch.ones(n, dtype=torch.bool)
    if has_tail:
        quantized[-1] = False
    sel = AdaptiveTopK(tau_cov=tau, k_min=k_min, k_max=k_max)
    order = rank_blocks(p, quantized)
    k = sel.choose_k(p, quantized, order)
    mask = sel.promoted(sel.ranks(order), k, ~quantized, group=1)
    n_q = int(quantized.sum())
    assert ((mask & quantized).sum(-1) == k).all()
    assert (~quantized <= mask).all()  # the exact tail block is always "promoted"
    assert (k <= min(k_max, n_q)).all() and (k >= min(k_min, n_q)).all()
    covered = (p * mask).sum(-1)
    reached = covered >= tau * p.sum(-1) - 1e-6
    assert (reached | (k == min(k_max, n_q))).all()
    # promoted blocks are the highest-mass quantized ones
    for h in range(3):
        chosen = p[h][mask[h] & quantized]
        rest = p[h][~mask[h] & quantized]
        if chosen.numel() and rest.numel():
            assert chosen.min() >= rest.max()


@given(seed=st.integers(0, 10_000), n=st.integers(1, 48), pad=st.integers(0, 8),
       tau=st.sampled_from([0.0, 0.5, 0.9, 0.995, 1.0]), k_min=st.integers(0, 3),
       k_max=st.integers(0, 40), exact=st.floats(0.0, 0.5), cap=st.sampled_from([None, 3]))
def test_a_device_count_chooses_as_the_host_count(seed, n, pad, tau, k_min, k_max, exact,
                                                  cap):
    """K* and rung 1's widened K* from the quantized count as a 0-d tensor (what a step
    captured in a graph reads, no host value) equal those from the host count, with exact
    windows among the blocks and the empty blocks of a padded layout after them (mass 0, not
    quantized)."""
    from certkv.certify.ladder import Ladder

    k_min = min(k_min, k_max)
    gen = torch.Generator().manual_seed(seed)
    p = torch.cat([masses(seed, 3, n, peaked=seed % 2 == 0), torch.zeros(3, pad)], dim=-1)
    quantized = torch.cat([torch.rand(n, generator=gen) >= exact,
                           torch.zeros(pad, dtype=torch.bool)])
    n_q = int(quantized.sum())
    sel, ladder = AdaptiveTopK(tau_cov=tau, k_min=k_min, k_max=k_max), Ladder(k_max=cap)
    order = rank_blocks(p, quantized)
    host = sel.choose_k(p, quantized, order, n_q)
    device = sel.choose_k(p, quantized, order, torch.tensor(n_q))
    assert torch.equal(host, device)
    assert torch.equal(ladder.expanded_k(host, k_max, n_q),
                       ladder.expanded_k(device, k_max, torch.tensor(n_q)))
    assert ladder.key_cap(k_max, n_q) == int(ladder.key_cap(k_max, torch.tensor(n_q)))


def test_minimal_k_for_coverage():
    p = torch.tensor([[0.6, 0.3, 0.06, 0.04]])
    quantized = torch.ones(4, dtype=torch.bool)
    for tau, expected in ((0.5, 1), (0.6, 1), (0.61, 2), (0.95, 3), (0.999, 4)):
        sel = AdaptiveTopK(tau_cov=tau, k_min=0, k_max=10)
        assert int(sel.choose_k(p, quantized, rank_blocks(p, quantized))) == expected


def test_exact_tail_mass_counts_as_covered():
    p = torch.tensor([[0.1, 0.05, 0.85]])
    quantized = torch.tensor([True, True, False])
    sel = AdaptiveTopK(tau_cov=0.9, k_min=0, k_max=10)
    assert int(sel.choose_k(p, quantized, rank_blocks(p, quantized))) == 1


def test_rank_upper_orders_by_the_mass_upper_bound():
    """``rank="upper"`` promotes by ``p_hat e^{Delta_b}``: a low-mass block with a wide bound
    goes before a heavier exact-ish one; ``"mass"`` keeps the paper's order."""
    p = torch.tensor([[0.5, 0.3, 0.2]])
    delta = torch.tensor([[0.0, 0.0, 2.0]])  # 0.2 e^2 = 1.48
    quantized = torch.ones(3, dtype=torch.bool)
    assert AdaptiveTopK().order(p, delta, quantized).tolist() == [[0, 1, 2]]
    assert AdaptiveTopK(rank="upper").order(p, delta, quantized).tolist() == [[2, 0, 1]]


def test_kv_group_union():
    mask = torch.tensor([[True, False, False], [False, False, True],
                         [False, True, False], [False, False, False]])
    union = union_by_kv_group(mask, group=2)
    assert union.tolist() == [[True, False, True]] * 2 + [[False, True, False]] * 2


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"tau_cov": 1.5}, "tau_cov=1.5 must lie in"),
    ({"k_min": 5, "k_max": 2}, "k_min=5 exceeds k_max=2"),
    ({"k_min": -1}, "k_min=-1 must be >= 0"),
    ({"mass_inflation": 1.0}, "use 2 or 3"),
    ({"rank": "best"}, "selector.rank='best' is unknown; use one of"),
])
def test_bad_selector_config(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdaptiveTopK(**kwargs)
