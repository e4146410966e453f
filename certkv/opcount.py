"""What one decode step dispatches: aten operators (per phase), host reads and GPU launches.

Issue 24 measures the certified step by its dispatch, not only its time: the eager reference
path runs hundreds of small aten operators per layer step where dense attention runs a handful,
each step reads the device twice from the host (the page-in plan, the fallback flags), and on
a GPU every operator is a kernel launch. :class:`StepCounter` counts all three for the calls
made inside it::

    counter = StepCounter()
    with counter.watching(attention):
        attention(q, store)
    counter.aten_ops, counter.by_phase, counter.host_reads, counter.launches

* ``aten_ops``: the aten operators called from Python or a compiled graph (the profiler's
  top-level ``aten::`` events; what an operator calls inside itself is not counted again). A
  ``torch.compile``d segment counts the operators its graph still calls (inductor's fused
  kernels are not aten operators), so the same counter compares eager and compiled steps.
* ``by_phase``: the same per :class:`~certkv.timing.PhaseTimer` phase of
  :class:`~certkv.CertifiedAttention` (``layout``, ``phase1``, ... ; ``other`` outside them).
* ``host_reads``: calls of :func:`certkv.attention.to_host`, through which every device-to-host
  read of a step goes (on a CPU store it is a copy within memory, counted all the same: it is
  where a GPU step waits).
* ``launches``: the CUDA activities the profiler records (kernels, and the copies and memsets
  the step issues; CUDA only, ``None`` elsewhere).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PHASE = "certkv::"  # the profiler label of a phase: certkv::<name>


class StepCounter:
    """Counts aten operators (total, per phase, per operator), host reads and GPU launches of
    the calls inside :meth:`watching`; see the module."""

    def __init__(self) -> None:
        self.by_phase: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.host_reads = 0
        self.launches: int | None = None

    @property
    def aten_ops(self) -> int:
        return sum(self.by_phase.values())

    def phase(self, name: str):
        """The :class:`~certkv.timing.PhaseTimer` protocol: a profiler label for ``name``."""
        return record_function(PHASE + name)

    @contextmanager
    def watching(self, attention=None, launches: bool | None = None):
        """Count inside the block; ``attention`` (a :class:`~certkv.CertifiedAttention`, or
        None) labels its phases. ``launches``: count CUDA activities (default: when CUDA is
        initialised)."""
        import certkv.attention as module

        launches = (torch.cuda.is_available() and torch.cuda.is_initialized()
                    if launches is None else launches)
        read, timer = module.to_host, getattr(attention, "timer", None)

        def counted(x):
            self.host_reads += 1
            return read(x)

        module.to_host = counted
        if attention is not None:
            attention.timer = self
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if launches else [])
        prof = profile(activities=activities)
        _without_stderr(prof.start)  # the profiler's C++ side prints start / stop lines
        try:
            yield self
        finally:
            _without_stderr(prof.stop)
            module.to_host = read
            if attention is not None:
                attention.timer = timer
        self._tally(prof.events(), launches)

    def _tally(self, events, launches: bool) -> None:
        """Top-level aten events by the phase label above them; CUDA activities."""
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                continue
            if not event.name.startswith("aten::"):
                continue
            phase, parent = "other", event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                if parent.name.startswith(PHASE):
                    phase = parent.name[len(PHASE):]
                    break
                parent = parent.cpu_parent
            if parent is not None and parent.name.startswith("aten::"):
                continue  # called by another operator
            self.by_phase[phase] += 1
            self.by_op[event.name[len("aten::"):]] += 1
        if launches:
            self.launches = sum(1 for e in events
                                if e.device_type == torch.autograd.DeviceType.CUDA)

    def summary(self) -> dict:
        """A JSON-able record: totals, per phase, the ten most frequent operators."""
        return {"aten_ops": self.aten_ops, "host_reads": self.host_reads,
                "launches": self.launches, "by_phase": dict(self.by_phase),
                "top_ops": dict(self.by_op.most_common(10))}


def _without_stderr(fn) -> None:
    """``fn()`` with file descriptor 2 pointed at the null device (C++ prints bypass Python)."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, 2)
        fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def count_step(step, attention=None) -> dict:
    """:meth:`StepCounter.summary` of one call of ``step()`` (``attention``: its method, for
    the phase split); call it after a warm-up step, so one-time work is not counted."""
    counter = StepCounter()
    with counter.watching(attention):
        step()
    return counter.summary()
