"""scripts/summary_bounds.py: how tightly each summary of evicted keys bounds their logits
(issue 56)."""

from __future__ import annotations

import pytest
import torch
from helpers import script


@pytest.fixture(scope="module")
def bounds():
    return script("summary_bounds.py")


def _keys(gen, hkv=2, n=3, block=16, d=32):
    """Adversarial keys: an outlier channel, a near-constant one, the rest Gaussian."""
    k = torch.randn(hkv, n, block, d, generator=gen, dtype=torch.float64)
    k[..., 3] *= 40.0
    k[..., 5] = 7.0 + 1e-6 * k[..., 5]
    return k


@pytest.mark.parametrize("name", ["box/8", "box/4", "pca2", "pca4", "pca8", "pca4+2b",
                                  "pca8+2b", "pca8+2b+norms"])
def test_every_proposed_form_bounds_each_token_logit_it_scores(bounds, name):
    """The logit a form scores a token at is within its Delta of the true one, on the test's
    own keys and queries (large and tiny query norms)."""
    gen = torch.Generator().manual_seed(3)
    kb = _keys(gen)
    for q_scale in (1e-3, 1.0, 300.0):
        qg = torch.randn(2, 3, 32, generator=gen, dtype=torch.float64) * q_scale
        scored, delta = bounds.proposed(name, qg, kb, 0.125)
        assert scored.shape == kb.shape and delta.shape == (2, 3, 3, 16)
        true = torch.einsum("hgd,hntd->hgnt", qg, kb) * 0.125
        held = torch.einsum("hgd,hntd->hgnt", qg, scored) * 0.125
        assert ((true - held).abs() <= delta).all()


def test_more_directions_or_finer_boxes_bound_no_worse(bounds):
    gen = torch.Generator().manual_seed(4)
    kb, qg = _keys(gen), torch.randn(2, 3, 32, generator=gen, dtype=torch.float64)
    mean = {name: float(bounds.proposed(name, qg, kb, 0.125)[1].mean())
            for name in ("box/8", "box/4", "pca4+2b", "pca8+2b", "pca8+2b+norms")}
    assert mean["box/4"] <= mean["box/8"]
    assert mean["pca8+2b+norms"] <= mean["pca8+2b"]


def test_bytes_follow_the_stated_formats(bounds):
    assert bounds.shipped_bytes("box", 64, 16) == 256  # the box codec's 4 d
    assert bounds.shipped_bytes("keys2", 64, 16) == 16 * 64 // 4 + 8 * 64
    assert bounds.proposed_bytes("box/4", 64, 16) == 4 * 256
    assert bounds.proposed_bytes("pca4", 64, 16) == 128 + 512 + 16 + 4
    assert bounds.proposed_bytes("pca4+2b+norms", 64, 16) == 660 + 16 + 32


def test_a_tiny_model_run_reports_every_summary(bounds):
    out = bounds.summary_bounds("tiny_random", 64, 2, weights="real")
    rows = {row["summary"]: row for row in out["rows"]}
    assert set(rows) == set(bounds.SHIPPED) | set(bounds.PROPOSED)
    assert 0 < rows["int8"]["delta"] < rows["keys4"]["delta"] < rows["keys2"]["delta"] \
        < rows["box"]["delta"]
    assert rows["box/4"]["delta"] <= rows["box/8"]["delta"]
    for row in rows.values():
        assert 0 <= row["mass_within_0.5"] <= row["mass_within_2"] <= 1 + 1e-9
    text = bounds.markdown([out], "cmd", {"commit": "x", "device": "cpu", "torch": "t"})
    assert "| pca8+2b+norms | no |" in text and "| box | yes | " in text
