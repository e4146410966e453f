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

* ``aten_ops``: operators that reach the dispatcher (a ``TorchDispatchMode``; views and
  factory calls count, Python control flow does not). A ``torch.compile``d segment counts the
  operators its graph still dispatches (inductor's generated kernels do not).
* ``by_phase``: the same per :class:`~certkv.timing.PhaseTimer` phase of
  :class:`~certkv.CertifiedAttention` (``layout``, ``phase1``, ... ; ``other`` outside them).
* ``host_reads``: calls of :func:`certkv.attention.to_host`, through which every device-to-host
  read of a step goes (on a CPU store it is a copy within memory, counted all the same: it is
  where a GPU step waits).
* ``launches``: GPU kernels launched (CUDA only, from the profiler; ``None`` elsewhere).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class StepCounter(TorchDispatchMode):
    """Counts aten operators (total, per phase, per operator) and host reads; see the module."""

    def __init__(self) -> None:
        super().__init__()
        self.by_phase: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.host_reads = 0
        self.launches: int | None = None
        self._phase = "other"

    @property
    def aten_ops(self) -> int:
        return sum(self.by_phase.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.by_phase[self._phase] += 1
        self.by_op[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @contextmanager
    def phase(self, name: str):
        """The :class:`~certkv.timing.PhaseTimer` protocol: operators inside count to ``name``."""
        outer, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = outer

    @contextmanager
    def watching(self, attention=None, launches: bool | None = None):
        """Count inside the block; ``attention`` (a :class:`~certkv.CertifiedAttention`, or
        None) attributes its operators to its phases. ``launches``: profile GPU kernel launches
        (default: when CUDA is initialised)."""
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
        try:
            with _kernel_profile() if launches else nullcontext() as profile, self:
                yield self
        finally:
            module.to_host = read
            if attention is not None:
                attention.timer = timer
        if launches:
            self.launches = sum(1 for e in profile.events()
                                if e.device_type == torch.autograd.DeviceType.CUDA)

    def summary(self) -> dict:
        """A JSON-able record: totals, per phase, the ten most frequent operators."""
        return {"aten_ops": self.aten_ops, "host_reads": self.host_reads,
                "launches": self.launches, "by_phase": dict(self.by_phase),
                "top_ops": dict(self.by_op.most_common(10))}


def _kernel_profile():
    """A profiler recording CUDA kernels only."""
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CUDA])


def count_step(step, attention=None) -> dict:
    """:meth:`StepCounter.summary` of one call of ``step()`` (``attention``: its method, for
    the phase split); call it after a warm-up step, so one-time work is not counted."""
    counter = StepCounter()
    with counter.watching(attention):
        step()
    return counter.summary()
