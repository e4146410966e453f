"""Compile every Triton launch for a CUDA GPU on a machine without one.

The Triton interpreter (``TRITON_INTERPRET=1``, how CI runs the kernels) executes a kernel's
Python body with NumPy; it accepts programs the compiler rejects (a loop-carried variable that
changes type, an integer argument equal to 1 that the JIT specialises into a constant). Triton's
wheel carries the whole CUDA compiler chain (MLIR passes, LLVM, ``ptxas``), and a kernel compiles
for a target without a device when the JIT is given the target and the arguments' types. So:

1. :func:`recording_launches` watches the interpreter while a workload runs and keeps one
   :class:`Launch` per distinct specialisation (kernel, argument dtypes, integer values,
   constexprs: what the JIT keys its cache on);
2. :func:`compile_for_cuda` compiles each in a fresh process without the interpreter (where
   ``@triton.jit`` gives real JIT functions) for ``sm_90`` by default, through ``ptxas``, and
   returns the failures, each with the compiler's message.

The GPU's own run stays the authority on numbers; this catches what the compiler refuses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

_DTYPE = "dtype:"


@dataclass(frozen=True)
class Launch:
    """One specialisation of a kernel: ``module.name`` with its arguments described (a
    tensor as ``"dtype:<torch dtype>"``, a scalar as itself) and its keyword constexprs."""

    module: str
    name: str
    args: tuple
    kwargs: tuple


def _describe(value):
    """An argument as the JIT specialises it: a tensor by its dtype, a scalar by value."""
    import torch

    if isinstance(value, torch.Tensor):
        return _DTYPE + str(value.dtype).removeprefix("torch.")
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple):  # a bundle of arguments (or a constexpr tuple)
        return tuple(_describe(x) for x in value)
    return getattr(value, "value", repr(value))  # tl.constexpr


LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "ir_override")  # a config's


@contextmanager
def recording_launches() -> Iterator[set[Launch]]:
    """Within the block, every Triton launch adds its :class:`Launch` to the yielded set."""
    from .launch_hooks import wrap_triton_launches

    launches: set[Launch] = set()

    def record(kernel, launch, args, kwargs):
        fn = kernel.fn
        options = tuple(sorted((k, _describe(v)) for k, v in kwargs.items()
                               if k not in ("grid", "warmup", *LAUNCH_OPTIONS)))
        launches.add(Launch(fn.__module__, fn.__name__,
                            tuple(_describe(a) for a in args), options))
        return launch(*args, **kwargs)

    restore = wrap_triton_launches(record)
    try:
        yield launches
    finally:
        restore()


def compile_for_cuda(launches, arch: int = 90, timeout: float = 900,
                     every_config: bool = False) -> dict[str, str]:
    """Compile ``launches`` for CUDA compute capability ``arch`` in a fresh process (no
    interpreter, no device needed); returns ``{"module.name": compiler message}`` of those
    that fail (empty when every one compiles). A kernel tuned over launch configurations
    (:mod:`~certkv.kernels.triton_tune`) compiles at its default one, or, with
    ``every_config``, at each."""
    specs = [{"module": x.module, "name": x.name, "args": list(x.args),
              "kwargs": [list(kv) for kv in x.kwargs], "every_config": every_config}
             for x in sorted(launches, key=repr)]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-m", __name__, str(arch)], input=json.dumps(specs),
                          capture_output=True, text=True, env=env, timeout=timeout, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the CUDA compile check itself failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


class _NoDevice:
    """The JIT's driver for a CUDA target with no device: the target, device 0, stream 0."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def _compile_all(specs: list[dict], arch: int) -> dict[str, str]:
    """Compile each spec with ``JITFunction.warmup`` (tensors stand in as their dtypes)."""
    import importlib

    import torch
    from triton.runtime import driver

    driver.set_active(_NoDevice(arch))

    def real(value, nested=False):
        """A described argument as the JIT takes it: a tensor as its dtype (inside a tuple,
        which the JIT specialises element by element, an empty tensor on the meta device)."""
        if isinstance(value, list):  # a tuple (JSON has lists only)
            return tuple(real(x, nested=True) for x in value)
        if isinstance(value, str) and value.startswith(_DTYPE):
            dtype = getattr(torch, value.removeprefix(_DTYPE))
            return torch.empty(1, dtype=dtype, device="meta") if nested else dtype
        return value

    failures: dict[str, str] = {}
    from certkv.kernels.triton_tune import DEFAULT, untuned

    for spec in specs:
        tuned = getattr(importlib.import_module(spec["module"]), spec["name"])
        kernel = untuned(tuned)
        configs = (tuned.configs if spec["every_config"] else [DEFAULT]) \
            if kernel is not tuned else [None]
        try:
            for config in configs:
                kernel.warmup(*map(real, spec["args"]), grid=(1,),
                              **{k: real(v) for k, v in spec["kwargs"]},
                              **(config.all_kwargs() if config else {}))
        except Exception as exc:  # the compiler's refusal, reported per kernel
            lines = str(exc).strip().splitlines() or [repr(exc)]
            cause = _root_cause(exc)  # the frame a nested call failed in says only "at 15:12"
            lines += [] if cause is exc else [f"caused by: {cause!r}"]
            failures.setdefault(f"{spec['module']}.{spec['name']}", "\n".join(lines[-13:]))
    return failures


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception a compiler error was raised from (its ``__cause__`` chain)."""
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    print(json.dumps(_compile_all(json.load(sys.stdin), int(sys.argv[1]))))
