"""The one hook on Triton's launch methods: every launch, compiled (``JITFunction``) or
interpreted (``TRITON_INTERPRET=1``), through a wrapper. The step counter
(:mod:`certkv.opcount`), recorded graphs (:mod:`certkv.graphs`) and the CUDA compile check
(:mod:`certkv.kernels.cuda_compile`) watch launches through it."""

from __future__ import annotations


def wrap_triton_launches(wrap):
    """Route every Triton launch (the JIT's and the interpreter's launch methods patched)
    through ``wrap(kernel, launch, args, kwargs)``, where ``launch(*args, **kwargs)`` runs it;
    returns the function that restores the methods (nothing to patch without Triton)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return lambda: None
    saved = {cls: cls.run for cls in (JITFunction, InterpretedFunction)}

    def patched(cls):
        def run(fn, *args, **kwargs):
            return wrap(fn, lambda *a, **k: saved[cls](fn, *a, **k), args, kwargs)
        return run

    for cls in saved:
        cls.run = patched(cls)

    def restore():
        for cls, run in saved.items():
            cls.run = run
    return restore


_QUIET: list = []  # the restore function of the one quiet wrapper, once installed


def quiet_interpreter() -> None:
    """Under ``TRITON_INTERPRET=1``, run every Triton launch with NumPy's floating-point
    warnings off, once per process: the interpreter computes with NumPy, which warns of the IEEE
    infinities and NaNs of masked lanes, empty sums (``log 0 = -inf``) and vacuous bounds
    that the kernels mean and a GPU computes silently. Nothing changes on a GPU."""
    import os

    if _QUIET or os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np

    def quiet(kernel, launch, args, kwargs):
        with np.errstate(all="ignore"):
            return launch(*args, **kwargs)

    _QUIET.append(wrap_triton_launches(quiet))
