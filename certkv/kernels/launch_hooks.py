"""The one hook on Triton's launch methods: every launch, compiled (``JITFunction``) or
interpreted (``TRITON_INTERPRET=1``), through the wrappers installed at the time. The step
counter (:mod:`certkv.opcount`), recorded graphs (:mod:`certkv.graphs`), the CUDA compile check
(:mod:`certkv.kernels.cuda_compile`) and the interpreter's quiet NumPy
(:func:`quiet_interpreter`) watch launches through it.

The launch methods are patched once per process and call the wrappers in a list, so wrappers
come and go in any order: removing one leaves every other in place (patching and restoring
the methods per wrapper would drop a wrapper installed after it and still in use).
"""

from __future__ import annotations

_WRAPS: list = []  # the installed wrappers; the last installed runs outermost
_PATCHED: list = []  # True once the launch methods are patched


def wrap_triton_launches(wrap):
    """Route every Triton launch through ``wrap(kernel, launch, args, kwargs)``, where
    ``launch(*args, **kwargs)`` runs it (through the wrappers installed before ``wrap``);
    returns the function that removes ``wrap`` again (nothing to patch without Triton)."""
    if not _patch():
        return lambda: None
    _WRAPS.append(wrap)

    def remove():
        for i, installed in enumerate(_WRAPS):
            if installed is wrap:
                del _WRAPS[i]
                return
    return remove


def _patch() -> bool:
    """Patch Triton's launch methods once to call :func:`_through`; False without Triton."""
    if _PATCHED:
        return True
    try:
        from triton.runtime.interpreter import InterpretedFunction
        from triton.runtime.jit import JITFunction
    except ImportError:
        return False

    def patched(saved):
        def run(fn, *args, **kwargs):
            return _through(tuple(_WRAPS), fn, lambda *a, **k: saved(fn, *a, **k), args, kwargs)
        return run

    for cls in (JITFunction, InterpretedFunction):
        cls.run = patched(cls.run)
    _PATCHED.append(True)
    return True


def _through(wraps: tuple, kernel, launch, args, kwargs):
    """``launch(*args, **kwargs)`` through ``wraps``, the last one outermost."""
    if not wraps:
        return launch(*args, **kwargs)
    *inner, outer = wraps
    return outer(kernel, lambda *a, **k: _through(tuple(inner), kernel, launch, a, k), args,
                 kwargs)


_QUIET: list = []  # the quiet wrapper's removal function, once installed


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
