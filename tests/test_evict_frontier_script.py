"""scripts/evict_frontier.py: the fewest evicted values a certificate must read (issue 56)."""

from __future__ import annotations

import pytest
import torch
from helpers import script

from certkv.registry import SUMMARIES


@pytest.fixture(scope="module")
def frontier():
    return script("evict_frontier.py")


def test_key_terms_bound_what_the_keys_change_in_the_output(frontier):
    """A block's key term bounds how far the output moves when its keys are read lossily (the
    test's own copy: softmax over logits perturbed within Delta_b, against the exact)."""
    gen = torch.Generator().manual_seed(2)
    block, d = 4, 8
    q = torch.randn(2, d, generator=gen)  # 2 query heads, 1 kv head
    k = torch.randn(1, 3 * block, d, generator=gen).half()
    v = torch.randn(1, 3 * block, d, generator=gen).half()
    p = frontier.block_probabilities(q, k, 0.5, block)
    delta = torch.full((2, 3), 0.3, dtype=torch.float64)
    notes, _ = frontier.block_notes(k, v, block, SUMMARIES.get("box")().precision())
    radius = torch.minimum(notes["nu"], notes["v_radius"]).amax(dim=-1).repeat_interleave(2)
    terms = frontier.key_terms(p, delta, radius)
    logits = (q.double() @ k[0].double().T) * 0.5
    centre = (v[0].double().amax(0) + v[0].double().amin(0)) / 2
    for sign in (1.0, -1.0):  # the logits shifted to either end of their interval
        shift = sign * 0.3 * torch.tensor([1.0, -1.0]).repeat(6 * block // 2)[: 3 * block]
        moved = torch.softmax(logits + shift, dim=-1) - torch.softmax(logits, dim=-1)
        drift = (moved.unsqueeze(-1) * (v[0].double() - centre)).sum(1).norm(dim=-1)
        assert (drift <= terms.sum(dim=-1) * (1 + 1e-9)).all()


def test_value_terms_are_the_sharpened_cor_4_2_terms_on_exact_probabilities(frontier):
    gen = torch.Generator().manual_seed(1)
    block, d = 4, 8
    q = torch.randn(4, d, generator=gen)  # 4 query heads, 2 kv heads
    k = torch.randn(2, 3 * block + 1, d, generator=gen).half()  # 3 blocks and a tail token
    v = torch.randn(2, 3 * block + 1, d, generator=gen).half()
    p = frontier.block_probabilities(q, k, 0.5, block)
    assert p.shape == (4, 3, block) and float(p.sum()) < 4  # the tail token holds the rest
    notes, _ = frontier.block_notes(k, v, block, SUMMARIES.get("box")().precision())
    terms = frontier.value_terms(p, notes["eta"].double(), notes["value_spec"].double(), 2)
    for h in range(4):
        for b in range(3):
            vb = v[h // 2, b * block:(b + 1) * block].double()
            centre = ((vb.amax(0) + vb.amin(0)) / 2).half().double()
            err = vb - centre
            actual = float((p[h, b, :, None] * err).sum(0).norm())  # what the block errs by
            radius = float(err.norm(dim=1).max())
            assert actual <= float(terms[h, b]) * (1 + 1e-9)  # the term bounds it
            assert float(terms[h, b]) <= float(p[h, b].sum()) * radius * (1 + 1e-6)


def test_the_frontier_of_a_tiny_model_reads_less_as_the_tolerance_grows(frontier):
    out = frontier.frontier("tiny_random", 96, 2, [0.5], weights="real")
    assert out["context"] == 96
    assert {r["policy"] for r in out["rows"]} == {"none", "streaming", "topmass"}
    for row in out["rows"]:
        evicts = row["policy"] != "none"
        assert (0 < row["kept_fraction"] < 1) == evicts and row["layer_steps"] > 0
        reads = [row["read_of_dense_kv"][str(t)] for t in out["tols"]]
        assert all(0 <= a <= 0.5 for a in reads) and reads == sorted(reads, reverse=True)
        shares = row["evicted_share_of_reads"].values()
        assert all(0 <= a <= 1 for a in shares) and (evicts or not any(shares))
        free = [row["heads_reading_none"][str(t)] for t in out["tols"]]
        assert free == sorted(free)
    assert {(r["keys"], r["budget"]) for r in out["whole_rows"]} == {
        ("int8", 1.0), ("box", 0.5), ("keys2", 0.5)}
    delta = out["key_delta"]  # every summary's logits looser than INT8 keys', box the loosest
    assert 0 < delta["int8"] < delta["keys4"] < delta["keys2"] < delta["box"]
    for row in out["whole_rows"]:
        reads = [row["read_of_dense_kv"][str(t)] for t in out["tols"]]
        assert all(0 <= a <= 1 for a in reads) and reads == sorted(reads, reverse=True)
    text = frontier.markdown([out], "cmd", {"commit": "x", "device": "cpu", "torch": "t"})
    for row in ("| none | 100% |", "| streaming | 50% |", "| topmass | 50% |", "| int8 | 100% |",
                "| keys2 | 50% |"):
        assert row in text
