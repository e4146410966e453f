"""Launch configurations the split kernels (Phase 1 and Phase 2) are tuned over on a GPU
(issue 55): ``num_warps`` and ``num_stages`` as ``triton.autotune`` configs.

The first launch of each shape (the key: ``G``, ``B``, ``D``, ``SPLIT`` and the arguments'
dtypes) on a CUDA device times every config (:func:`_timed`) and keeps the fastest for the
process; every other
launch, the interpreter's (``TRITON_INTERPRET=1``) and one inside a CUDA graph capture take
:data:`DEFAULT`, the configuration an untuned launch has (so CPU runs and their launch counts do
not change). ``CERTKV_AUTOTUNE=0`` pins :data:`DEFAULT` on a GPU too (reproducible timings).

Tuning cannot move a certificate beyond its own bound: a config changes how a program's
reductions are ordered across threads, never what they sum, and the rounding chains the bound
counts (:meth:`~certkv.kernels.triton_backend.TritonBackend.rounding`: two-level dot products,
``B``-term block sums, ``SPLIT`` blocks per program, chosen on the host) hold for every order.
Results may differ in their last bits between configs, hence between processes that tuned
differently. The kernels tuned write only their outputs (no atomics, nothing read back), so
timing a config's launches leaves no trace. A graph's first eager step of a shape tunes it
before the capture that follows (:mod:`certkv.graphs`).

Tensor-core ``tl.dot`` is not used for the logits or value sums: their inputs are FP32 (scaled
queries, decoded codes), which TF32 or FP16 tensor cores would round by up to ``2^-11``
relatively, a term the bound would have to carry on every product, and tensor cores
accumulate FP32 sums with truncation rather than IEEE rounding (as others measured; NVIDIA
specifies none), so a bound resting on them would rest on undocumented hardware behaviour.
The rotation codecs' back-rotation is an FP32 ``tl.dot`` with ``input_precision="ieee"`` (IEEE
products and sums).
"""

from __future__ import annotations

import os

import torch
import triton

ENV = "CERTKV_AUTOTUNE"
DEFAULT = triton.Config({}, num_warps=4, num_stages=3)  # Triton's default launch on CUDA
CONFIGS = [DEFAULT, *(triton.Config({}, num_warps=w, num_stages=s)
                      for w in (2, 4, 8) for s in (1, 2, 3) if (w, s) != (4, 3))]
KEY = ["G", "B", "D", "SPLIT"]


def tuning_on(device: torch.device) -> bool:
    """Whether launches on ``device`` are tuned now: a CUDA device, ``CERTKV_AUTOTUNE`` not
    ``0``, no graph being captured (a capture cannot time launches)."""
    return (device.type == "cuda" and os.environ.get(ENV, "1") != "0"
            and not torch.cuda.is_current_stream_capturing())


def _first_device(args) -> torch.device:
    """The device of the first tensor among a launch's arguments (bundles searched in order)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value.device
        if isinstance(value, tuple):
            found = _first_device(value)
            if found.type != "meta":
                return found
    return torch.device("meta")


def prune(configs, named_args, **kwargs):
    """``early_config_prune``: every config where :func:`tuning_on`, else :data:`DEFAULT`."""
    return configs if tuning_on(_first_device(named_args.values())) else [DEFAULT]


TUNED: list = []  # every autotuned kernel, in definition order


def _timed(launch, quantiles):
    """A config's time: 5 ms of warm-up, 20 ms of launches (a shape tunes in about 0.25 s)."""
    from triton.testing import do_bench

    return do_bench(launch, warmup=5, rep=20, quantiles=quantiles)


def autotuned(kernel):
    """``kernel`` (a ``triton.jit`` function with the constexprs of :data:`KEY`) tuned over
    :data:`CONFIGS` as the module says."""
    tuned = triton.autotune(configs=CONFIGS, key=KEY, do_bench=_timed,
                            prune_configs_by={"early_config_prune": prune})(kernel)
    TUNED.append(tuned)
    return tuned


def chosen() -> list[tuple[str, str, str]]:
    """``(kernel, shape, config)`` for every shape a tuned kernel has launched at in this
    process: the shape as ``G=.. B=.. D=.. SPLIT=..`` (its dtypes left out), the config kept as
    ``num_warps=.., num_stages=..``."""
    rows = []
    for tuned in TUNED:
        for key, config in tuned.cache.items():
            shape = " ".join(f"{name}={value}" for name, value in zip(KEY, key, strict=False))
            rows.append((untuned(tuned).__name__, shape,
                         f"num_warps={config.num_warps}, num_stages={config.num_stages}"))
    return rows


def untuned(kernel):
    """The ``triton.jit`` function under an :func:`autotuned` kernel (itself otherwise)."""
    from triton.runtime.autotuner import Autotuner

    return kernel.fn if isinstance(kernel, Autotuner) else kernel
