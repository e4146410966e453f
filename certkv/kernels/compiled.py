"""The step's compiled segments: ``torch.compile`` of a pure tensor function with an eager
fallback, and its arguments held in the one form the compiled graph was made for."""

from __future__ import annotations

import warnings

import torch


class CompiledSegment:
    """``torch.compile(fn)`` with an eager fallback: compilation problems (a missing toolchain,
    an unsupported op) cost speed, never a decode step."""

    def __init__(self, fn, backend: str) -> None:
        self.fn, self.backend, self.compiled = fn, backend, None
        try:
            self.compiled = torch.compile(fn, backend=backend, dynamic=True, fullgraph=True)
        except Exception as exc:  # any compiler failure: fall back
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        warnings.warn(f"torch.compile (backend={self.backend!r}) failed for "
                      f"{self.fn.__name__}: {type(exc).__name__}: {exc}; running it eagerly "
                      "(set compile=False to silence this).", RuntimeWarning, stacklevel=3)
        self.compiled = None

    def __call__(self, *args):
        if self.compiled is not None:
            try:
                return self.compiled(*(steady(a) for a in args))
            except Exception as exc:  # compiler errors surface at first call
                self._give_up(exc)
        return self.fn(*args)


def steady(x):
    """A segment argument in the one form the compiled graph was made for: contiguous (a view
    of a growing buffer has a stride that changes with its capacity) and, under inference mode,
    an inference tensor (a tensor made before the first step is not). Either difference fails
    a guard and recompiles; on a real model these recompiles reached dynamo's limit (8) within
    minutes and left the segments eager for the rest of the run. The arguments are per-head and
    per-block tensors, so the copies are small. Named inputs (a NamedTuple) field by field."""
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return x._make(steady(a) for a in x)
    if not isinstance(x, torch.Tensor):
        return x
    if torch.is_inference_mode_enabled() and not x.is_inference():
        return x.clone(memory_format=torch.contiguous_format)
    return x.contiguous()
