"""Targeted page-in's pure math (certkv.certify.targeted): which blocks break eq. 18, and which
of them a page-in budget reads."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certkv.certify.checks import boundary_ok
from certkv.certify.targeted import boundary_breakers, plan


@st.composite
def checks(draw):
    hkv, group, n = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.integers(2, 24))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    hq = hkv * group
    l8 = torch.randn(hq, n, generator=g) * 3
    l16 = l8 + torch.randn(hq, n, generator=g) * 0.3
    delta_b = torch.rand(hq, n, generator=g) * draw(st.sampled_from([0.1, 1.0, 8.0]))
    promoted = torch.rand(hq, n, generator=g) < draw(st.sampled_from([0.1, 0.4, 0.8]))
    quantized = torch.rand(n, generator=g) < 0.9
    return hkv, l8, l16, delta_b, promoted, quantized, draw(st.integers(1, 3))


@settings(max_examples=150, deadline=None)
@given(x=checks())
def test_breakers_are_what_fails_eq18_and_promoting_them_mends_it(x):
    """A head fails the boundary check exactly when it has a breaker; with its breakers
    promoted the check holds whenever r promoted blocks exist (promoting never lowers the
    r-th promoted FP16 log-mass)."""
    _, l8, l16, delta_b, promoted, quantized, r = x
    ok = boundary_ok(l8, l16, delta_b, promoted, quantized & ~promoted, r)
    breakers, upper = boundary_breakers(l8, l16, delta_b, promoted, quantized, r)
    assert torch.equal(breakers.any(dim=-1), ~ok)
    assert (upper[~(quantized & ~promoted)] == float("-inf")).all()
    mended = promoted | breakers
    ok_after = boundary_ok(l8, l16, delta_b, mended, quantized & ~mended, r)
    enough = mended.sum(dim=-1) >= r
    assert ok_after[enough].all()


@settings(max_examples=150, deadline=None)
@given(x=checks(), budget=st.sampled_from([None, 0, 1, 3]))
def test_the_budget_reads_the_largest_upper_bounds_first(x, budget):
    """The plan reads at most ``budget`` new (kv head, block) pairs, those with the largest
    upper bounds; breakers whose keys are read already are promoted for free."""
    hkv, l8, l16, delta_b, promoted, quantized, r = x
    breakers, upper = boundary_breakers(l8, l16, delta_b, promoted, quantized, r)
    hq, n = breakers.shape
    group = hq // hkv
    paged = promoted.view(hkv, group, n).any(dim=1) & quantized
    force, pairs = plan(breakers, upper, paged, budget)
    assert (force <= breakers).all()
    per_kv = force.view(hkv, group, n).any(dim=1)
    new = per_kv & ~paged
    assert int(new.sum()) <= pairs and (budget is None or pairs <= budget)
    free = breakers & paged.repeat_interleave(group, dim=0)
    assert (force[free]).all()
    wanted = breakers.view(hkv, group, n).any(dim=1) & ~paged
    if budget is None or int(wanted.sum()) <= budget:
        assert torch.equal(force, breakers)
    else:  # every left-out pair's upper bound is at most every chosen one's
        score = upper.view(hkv, group, n).masked_fill(~breakers.view(hkv, group, n),
                                                      float("-inf")).amax(dim=1)
        chosen, left = score[new], score[wanted & ~new]
        if chosen.numel() and left.numel():
            assert left.max() <= chosen.min()


def test_tolerance_plan_leaves_each_over_head_at_most_its_limit_by_the_fewest_blocks():
    """The plan takes, per head over its tolerance, the fewest blocks whose shares (the
    per-block TV term times R where keys are lossy, rho eta where values are; recomputed here)
    leave the rest within the limit; heads within it and blocks already read whole take none."""
    from certkv.certify.certificate import BlockStats
    from certkv.certify.targeted import tolerance_plan

    g = torch.Generator().manual_seed(3)
    hkv, group, n = 2, 2, 12
    hq = hkv * group
    mass = torch.softmax(torch.randn(hq, n, generator=g) * 2, dim=-1)
    delta = torch.rand(hq, n, generator=g) * 3
    eta = torch.rand(hkv, n, generator=g)
    radius = torch.rand(hq, generator=g) + 0.5
    quantized = torch.ones(n, dtype=torch.bool)
    quantized[-1] = False  # the exact tail block
    eta[:, -1] = 0
    keys_read = torch.zeros(hq, n, dtype=torch.bool)
    keys_read[:, 0] = True  # block 0's keys read by every head
    values_read = torch.zeros(hkv, n, dtype=torch.bool)
    values_read[:, 1] = True
    over = torch.tensor([True, True, False, True])
    limit = torch.tensor([0.05, 0.5, 0.05, 0.0], dtype=torch.float64)
    blocks = BlockStats(mass, eta, delta, radius, quantized)
    plan, pairs = tolerance_plan(blocks, (keys_read, values_read), over, limit)

    rho, d = mass.double(), delta.double()
    lossy_k = quantized & ~keys_read
    w = torch.maximum(1 - (rho * (1 - torch.exp(-d)) * lossy_k).sum(-1),
                      torch.exp(-(d * lossy_k).amax(-1)))
    shares = (torch.expm1(d) * rho * lossy_k) * (2 * radius.double() / w)[:, None]
    eta_q = eta.double().repeat_interleave(group, 0)
    shares += rho * eta_q * ~values_read.repeat_interleave(group, 0)
    assert not plan[2].any()  # within its tolerance
    assert not plan[:, -1].any()  # the exact tail block carries nothing
    for h in (0, 1, 3):
        left = shares[h][~plan[h]].sum()
        assert left <= limit[h]
        # no smaller set: without its smallest chosen share the rest exceeds the limit
        chosen = shares[h][plan[h]]
        assert left + chosen.min() > limit[h]
    assert plan[3].sum() == (shares[3] > 0).sum()  # a limit of 0: every lossy share
    paged = keys_read.view(hkv, group, n).any(1)
    assert pairs == int((plan.view(hkv, group, n).any(1) & ~paged).sum())
