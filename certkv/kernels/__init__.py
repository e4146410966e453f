"""Attention backends: PyTorch reference (and, later, Triton kernels)."""

from certkv.kernels.dispatch import get_backend
from certkv.kernels.reference import TorchBackend, dense_attention

__all__ = ["TorchBackend", "dense_attention", "get_backend"]
