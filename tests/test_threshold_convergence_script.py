"""scripts/threshold_convergence.py: seed 004's adaptive tier boundaries over a decode, and when
each layer's last moved."""

from __future__ import annotations

import torch
from helpers import script


def load():
    return script("threshold_convergence.py")


def test_every_layer_decides_once_per_window_within_the_limits():
    script = load()
    from certkv.bench.decode import _decode_model, _decode_prompt

    lm, _ = _decode_model("tiny_random", "real", torch.device("cpu"), torch.float32)
    ids = _decode_prompt(lm, 96 + 30)
    run = script.run_window(lm, ids, 96, 30, 5)
    assert len(run["layers"]) == lm.num_layers
    for history in run["layers"]:
        assert [d["step"] for d in history] == [5, 10, 15, 20, 25, 30]
        for d in history:
            assert 32 <= d["hot"] <= 256 and max(128, d["hot"]) <= d["stale"] <= 4096
            assert d["verdict"] in ("archive more", "keep", "archive less")


def test_settled_says_when_the_boundaries_last_moved_and_how_often_verdicts_flipped():
    history = [{"step": 10, "hot": 58, "stale": 461, "verdict": "archive more"},
               {"step": 20, "hot": 70, "stale": 553, "verdict": "archive less"},
               {"step": 30, "hot": 70, "stale": 553, "verdict": "keep"},
               {"step": 40, "hot": 63, "stale": 498, "verdict": "archive more"},
               {"step": 50, "hot": 63, "stale": 498, "verdict": "keep"}]
    got = load().settled(history, [64, 512])
    assert got == {"last_move_step": 40, "last_move_decision": 4, "flips": 2, "hot": 63,
                   "stale": 498}
    assert load().settled([], [64, 512])["last_move_step"] == 0
