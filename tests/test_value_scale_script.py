"""scripts/value_scale.py: the value norms and INT4 block errors behind E_val's scale."""

from __future__ import annotations

from helpers import script


def load():
    return script("value_scale.py")


def test_value_scale_reports_ordered_quantiles_of_norms_and_block_errors():
    out = load().value_scale("tiny_random", 96, weights="real")  # its conf: a random model
    assert out["model"] == "tiny_random" and out["context"] == 96
    for name in ("value_norm", "eta_b", "eta_b_relative"):
        q = out[name]
        assert 0 <= q["p5"] <= q["p50"] <= q["p95"], name
    # the INT4 codec's error is a small fraction of the block's largest value norm
    assert 0 < out["eta_b_relative"]["p95"] < 0.5
