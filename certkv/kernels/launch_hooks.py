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
