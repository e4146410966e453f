"""``python -m certkv.warm`` (what ``make setup`` runs to fill numba's cache) reaches the kernels
a decode runs: the default certified step as its one compiled call, the dense numba loops."""

from __future__ import annotations

import torch

from certkv import warm
from certkv.kernels import numba_dense, numba_step


def test_a_warm_decode_runs_the_one_call_certified_step(monkeypatch):
    calls = []
    original = numba_step.run
    monkeypatch.setattr(numba_step, "run", lambda *a, **k: calls.append(1) or original(*a, **k))
    quantizer = warm._component("quantizer", "int8_int4")
    warm._decode(quantizer, "certified", torch.float16)
    assert len(calls) == 2  # both steps, none on the phase-by-phase path


def test_a_warm_dense_decode_runs_the_numba_loops(monkeypatch):
    calls = []
    original = numba_dense._dense
    monkeypatch.setattr(numba_dense, "_dense", lambda *a, **k: calls.append(1) or original(*a, **k))
    warm._decode(warm._component("quantizer", "int8_int4"), "dense", torch.float32)
    assert calls
