"""Attention backends: PyTorch reference (and, later, Triton kernels)."""

from certkv.cache.fused import provide_block_encoder
from certkv.kernels.dispatch import get_backend
from certkv.kernels.reference import TorchBackend, dense_attention


def _quantize_blocks(k16, v16, group):
    """The Triton block encoder, imported when a store first uses it (Triton loads late)."""
    from certkv.kernels.triton_quantize import quantize_blocks

    return quantize_blocks(k16, v16, group)


provide_block_encoder(_quantize_blocks)

__all__ = ["TorchBackend", "dense_attention", "get_backend"]
