"""Runtime checks (paper 6, 6.1): constructed ranking swaps, boundary violations, canary."""

from __future__ import annotations

import torch

from certkv.certify import Ladder
from certkv.certify.checks import (
    boundary_ok,
    canary_violations,
    exploration_mask,
    paged_summaries,
    rank_checks,
    ranking_consistent,
    top_r,
)

ALL = torch.tensor([[True, True, True, False]])


def test_ranking_check_fires_on_a_swap():
    l8 = torch.tensor([[5.0, 4.9, 1.0, 0.0]])
    same = torch.tensor([[5.1, 4.8, 1.2, 0.0]])
    swapped = torch.tensor([[4.8, 5.1, 1.2, 0.0]])
    assert ranking_consistent(l8, same, ALL, r=1).all()
    assert not ranking_consistent(l8, swapped, ALL, r=1).any()
    # a swap below depth r is tolerated, at depth 3 it is not
    lower = torch.tensor([[5.1, 4.8, 4.9, 0.0]])
    l8b = torch.tensor([[5.0, 4.0, 3.9, 0.0]])
    assert ranking_consistent(l8b, lower, ALL, r=1).all()
    assert not ranking_consistent(l8b, lower, ALL, r=3).any()


def test_ranking_ignores_unpromoted_blocks_and_short_sets():
    l8 = torch.tensor([[1.0, 9.0, 2.0, 0.0]])
    l16 = torch.tensor([[1.0, -9.0, 2.0, 0.0]])
    promoted = torch.tensor([[True, False, True, False]])
    assert ranking_consistent(l8, l16, promoted, r=1).all()
    assert ranking_consistent(l8, l16, promoted, r=5).all()  # only 2 promoted: compare those


def test_a_paged_summary_ranks_by_its_originals_and_codes_still_by_theirs():
    """``paged_summaries``: a promoted summary block (1) takes its FP16 log-mass in eq. 17's
    Phase-1 list, so its estimate's misorder no longer fails the check; a misorder between
    blocks scored from codes (0, 2) still does; an unpromoted summary block (3) keeps its
    estimate, which eq. 18 bounds."""
    summaries = torch.tensor([False, True, False, True])
    promoted = torch.tensor([[True, True, False, False], [True, False, True, False]])
    l8 = torch.tensor([[5.0, 6.0, 1.0, 2.0], [5.0, 0.0, 4.0, 2.0]])
    l16 = torch.tensor([[5.0, 4.0, 1.0, 9.0], [4.0, 0.0, 5.0, 9.0]])
    paged = paged_summaries(l8, l16, promoted, summaries)
    assert paged.tolist() == [[5.0, 4.0, 1.0, 2.0], [5.0, 0.0, 4.0, 2.0]]
    delta = torch.zeros(2, 4)
    quantized = torch.ones(4, dtype=torch.bool)
    assert ranking_consistent(l8, l16, promoted, r=1).tolist() == [False, False]
    ranking, boundary = rank_checks(paged, l16, delta, promoted, quantized, r=1)
    assert ranking.tolist() == [True, False]
    assert torch.equal(boundary, rank_checks(l8, l16, delta, promoted, quantized, r=1)[1])


def test_boundary_check_fires_when_a_tail_block_could_enter_top_r():
    l8 = torch.tensor([[5.0, 4.0, 3.0, 4.6]])
    l16 = torch.tensor([[5.0, 4.0, 3.0, 0.0]])
    delta = torch.tensor([[0.1, 0.1, 0.1, 0.3]])
    promoted = torch.tensor([[True, True, True, False]])
    tail = ~promoted
    assert boundary_ok(l8, l16, delta, promoted, tail, r=1).all()  # 4.9 <= 5.0
    assert not boundary_ok(l8, l16, delta, promoted, tail, r=2).any()  # 4.9 > 4.0
    bigger = torch.tensor([[0.1, 0.1, 0.1, 0.5]])
    assert not boundary_ok(l8, l16, bigger, promoted, tail, r=1).any()  # 5.1 > 5.0


def test_boundary_cannot_certify_with_too_few_promoted_blocks():
    l8 = torch.tensor([[5.0, -10.0]])
    promoted = torch.tensor([[True, False]])
    assert not boundary_ok(l8, l8, torch.zeros(1, 2), promoted, ~promoted, r=2).any()
    no_tail = torch.tensor([[True, True]])
    assert boundary_ok(l8, l8, torch.zeros(1, 2), no_tail, ~no_tail, r=3).all()


def test_canary_detects_scores_outside_delta():
    s8 = torch.tensor([[[1.0, 2.0], [3.0, float("-inf")]]])  # [heads, blocks, B]
    delta = torch.tensor([[0.1, 0.1]])
    assert not canary_violations(s8, s8 + 0.09, delta, 1e-6).any()
    bad = s8.clone()
    bad[0, 1, 0] += 0.5
    assert canary_violations(s8, bad, delta, 1e-6).tolist() == [[False, True]]
    assert not canary_violations(s8, bad, delta + 0.5, 1e-6).any()


def test_ranking_breaks_ties_by_block_index():
    l8 = torch.tensor([[2.0, 3.0, 3.0, 1.0]])
    promoted = torch.ones(1, 4, dtype=torch.bool)
    _, idx, _ = top_r(l8, promoted, 3)
    assert idx.tolist() == [[1, 2, 0]]
    assert ranking_consistent(l8, l8, promoted, r=3).all()


def test_exploration_draws_only_tail_blocks():
    tail = torch.tensor([[True, False, True, True] * 50])
    draw = Ladder(exploration=0.3, seed=0).exploration_draw(tail.shape, "cpu")
    picked = exploration_mask(tail, draw, 0.3)
    assert (picked <= tail).all()
    assert 0.15 < picked.sum() / tail.sum() < 0.45
    assert not exploration_mask(tail, draw, 0.0).any()
    assert Ladder(exploration=0.0).exploration_draw(tail.shape, "cpu") is None
    again = Ladder(exploration=0.3, seed=0).exploration_draw(tail.shape, "cpu")
    assert torch.equal(draw, again)  # seeded
