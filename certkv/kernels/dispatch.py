"""Backend choice: ``torch`` (reference, any device); ``auto`` picks the best available."""

from __future__ import annotations

from certkv.errors import ConfigError
from certkv.kernels.reference import TorchBackend

BACKENDS = {"torch": TorchBackend}


def get_backend(backend: str | object = "auto", **kwargs):
    """Return a backend object for a name (``auto``, ``torch``) or pass an instance through."""
    if not isinstance(backend, str):
        return backend
    name = "torch" if backend == "auto" else backend
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {backend!r}; choose one of {['auto', *BACKENDS]}.")
    return BACKENDS[name](**kwargs)
