"""Backend choice: ``torch`` (reference, any device), ``triton`` (fused kernels), ``numba``
(the reference with its phases fused on CPU), ``auto`` (Triton on CUDA when available, else
numba where it is installed, else the reference)."""

from __future__ import annotations

from certkv.errors import ConfigError
from certkv.kernels.base import Backend
from certkv.kernels.reference import TorchBackend
from certkv.registry import BACKENDS

BACKENDS.register("torch")(TorchBackend)


@BACKENDS.register("numba")
def _numba(**kwargs):
    from certkv.kernels.numba_backend import NumbaBackend

    return NumbaBackend(**kwargs)


@BACKENDS.register("triton")
def _triton(**kwargs):
    from certkv.kernels.triton_backend import TritonBackend

    return TritonBackend(**kwargs)



def get_backend(backend: str | object = "auto", **kwargs):
    """Return a backend object for a name (``auto``, ``torch``, ``triton``, ``numba``) or
    pass an instance through."""
    if not isinstance(backend, str):
        if not isinstance(backend, Backend):
            raise ConfigError(f"backend={backend!r} is not a backend; use 'auto' or one of "
                              f"{BACKENDS.names()} (or a certkv.kernels.Backend object).")
        return backend
    if backend == "auto":
        import torch

        from certkv.kernels.numba_backend import AVAILABLE
        from certkv.kernels.triton_backend import triton_available

        backend = "triton" if torch.cuda.is_available() and triton_available() \
            else "numba" if AVAILABLE else "torch"
        kwargs = {} if backend == "triton" else kwargs
    return BACKENDS.get(backend)(**kwargs)
