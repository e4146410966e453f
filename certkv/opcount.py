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
* ``host_reads``: calls of :func:`certkv.step.to_host`, through which every device-to-host
  read of a step goes (on a CPU store it is a copy within memory, counted all the same: it is
  where a GPU step waits).
* ``launches``: the CUDA activities the profiler records (kernels, and the copies and memsets
  the step issues; CUDA only, ``None`` elsewhere).
* ``kernels``: Triton kernel launches (counted on CUDA and under ``TRITON_INTERPRET=1`` alike;
  what the interpreter runs inside a launch is not counted as aten operators).
* ``segments``: calls of the step's pure tensor segments (selection, certificate, the device
  LRU), each one compiled graph on CUDA.
* ``eager_launches``: the aten operators outside Triton kernels and segments that compute or
  copy (views and allocations left out): each is a kernel launch on CUDA. With ``kernels`` and
  ``segments`` they are what a CPU run can say of a GPU step's launches (issue 24's target:
  at most 10 per certified layer step).
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from certkv.kernels.launch_hooks import wrap_triton_launches

PHASE = "certkv::"  # the profiler label of a phase: certkv::<name>
KERNEL, SEGMENT = "certkv-kernel::", "certkv-segment::"  # labels of launches and segments
# aten operators that launch nothing on CUDA: views, metadata and allocations.
NO_LAUNCH = frozenset({
    "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "expand",
    "lift_fresh", "narrow", "permute", "select", "slice", "split", "squeeze", "t",
    "transpose", "unbind", "unflatten", "unsqueeze", "view", "_unsafe_view", "_reshape_alias",
    "view_as", "result_type", "is_nonzero", "size", "stride", "detach_"})
# ... unless they copy (a dtype or device change, a non-contiguous input): then a child does.
MAY_COPY = frozenset({"to", "type_as", "contiguous", "flatten", "reshape"})


class StepCounter:
    """Counts aten operators (total, per phase, per operator), host reads and GPU launches of
    the calls inside :meth:`watching`; see the module."""

    def __init__(self) -> None:
        self.by_phase: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.host_reads = 0
        self.launches: int | None = None
        self.kernels: Counter[str] = Counter()
        self.segments: Counter[str] = Counter()
        self.eager: Counter[str] = Counter()  # launching aten operators outside both

    @property
    def aten_ops(self) -> int:
        return sum(self.by_phase.values())

    @property
    def eager_launches(self) -> int:
        return sum(self.eager.values())

    def phase(self, name: str):
        """The :class:`~certkv.timing.PhaseTimer` protocol: a profiler label for ``name``."""
        return record_function(PHASE + name)

    @contextmanager
    def watching(self, attention=None, launches: bool | None = None):
        """Count inside the block; ``attention`` (a :class:`~certkv.CertifiedAttention`, or
        None) labels its phases. ``launches``: count CUDA activities (default: when CUDA is
        initialised)."""
        import certkv.step as module

        launches = (torch.cuda.is_available() and torch.cuda.is_initialized()
                    if launches is None else launches)
        read, timer = module.to_host, getattr(attention, "timer", None)

        def counted(x):
            self.host_reads += 1
            return read(x)

        module.to_host = counted
        if attention is not None:
            attention.timer = self
            attention._segment = self._labelled_segments(attention._segment)
        restore = self._label_kernels()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if launches else [])
        prof = profile(activities=activities)
        _without_stderr(prof.start)  # the profiler's C++ side prints start / stop lines
        try:
            yield self
        finally:
            _without_stderr(prof.stop)
            module.to_host = read
            restore()
            if attention is not None:
                attention.timer = timer
                del attention._segment  # the class's method again
        self._tally(prof.events(), launches)

    def _labelled_segments(self, segment):
        """``attention._segment`` whose segments count their calls under a profiler label."""
        def labelled(name, device):
            fn = segment(name, device)

            def call(*args):
                self.segments[name.strip("_")] += 1
                with record_function(SEGMENT + name):
                    return fn(*args)
            return call
        return labelled

    def _label_kernels(self):
        """Count Triton launches under a profiler label; returns the function that removes
        the counting wrapper again (:func:`wrap_triton_launches`)."""
        def labelled(fn, launch, args, kwargs):
            name = getattr(getattr(fn, "fn", None), "__name__", "kernel")
            self.kernels[name] += 1
            with record_function(KERNEL + name):
                return launch(*args, **kwargs)
        return wrap_triton_launches(labelled)

    def _tally(self, events, launches: bool) -> None:
        """Top-level aten events by the phase label above them (none inside a Triton launch:
        the interpreter's), the launching ones outside segments; CUDA activities."""
        for event in events:
            if event.device_type == torch.autograd.DeviceType.CUDA:
                continue
            if not event.name.startswith("aten::"):
                continue
            labels = _labels(event)
            if labels is None or any(x.startswith(KERNEL) for x in labels):
                continue  # called by another operator, or by the Triton interpreter
            phase = next((x[len(PHASE):] for x in labels if x.startswith(PHASE)), "other")
            op = event.name[len("aten::"):]
            self.by_phase[phase] += 1
            self.by_op[op] += 1
            if _launches(event, op) and not any(x.startswith(SEGMENT) for x in labels):
                self.eager[op] += 1
        if launches:
            self.launches = sum(1 for e in events
                                if e.device_type == torch.autograd.DeviceType.CUDA)

    def summary(self) -> dict:
        """A JSON-able record: totals, per phase, the ten most frequent operators, Triton
        launches, segment calls and eager launching operators."""
        return {"aten_ops": self.aten_ops, "host_reads": self.host_reads,
                "launches": self.launches, "by_phase": dict(self.by_phase),
                "top_ops": dict(self.by_op.most_common(10)),
                "kernels": sum(self.kernels.values()), "segments": sum(self.segments.values()),
                "eager_launches": self.eager_launches}


def _launches(event, op: str) -> bool:
    """Whether the top-level operator ``event`` (named ``op``) computes or copies."""
    if op in MAY_COPY:
        return any(_launches(child, child.name[len("aten::"):]) for child in event.cpu_children
                   if child.name.startswith("aten::"))
    return op not in NO_LAUNCH


def _labels(event) -> list[str] | None:
    """The non-aten profiler labels above ``event``, innermost first; None when an aten
    operator is above it (it is not top level)."""
    labels, parent = [], event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return None
        labels.append(parent.name)
        parent = parent.cpu_parent
    return labels


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
