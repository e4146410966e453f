"""Phase timers for benchmarks (paper Table 16): wall time per named phase, CUDA-synchronised."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch


class PhaseTimer:
    """Accumulates milliseconds per phase name; synchronises CUDA around each phase.

    ``per_phase``: a step timed by this timer runs its phases one call each (the numba
    backend's one-call step, :mod:`certkv.kernels.numba_step`, has no phases to time inside)."""

    per_phase = True

    def __init__(self) -> None:
        self.ms: dict[str, float] = defaultdict(float)
        self.calls = 0

    @contextmanager
    def phase(self, name: str):
        _sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            _sync()
            self.ms[name] += 1e3 * (time.perf_counter() - start)

    def reset(self) -> None:
        self.ms.clear()
        self.calls = 0


class NullTimer:
    """No-op stand-in used when nothing is being measured."""

    def phase(self, name: str):
        return _NOTHING


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


_NOTHING = nullcontext()  # reusable: it keeps no state
NULL_TIMER = NullTimer()
