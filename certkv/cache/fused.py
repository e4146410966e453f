"""The fused block encoder a store may use, provided from above (the cache layer never imports
the kernels).

:mod:`certkv.kernels` provides :func:`certkv.kernels.triton_quantize.quantize_blocks` when it is
imported (as every attention step does); a store asks :func:`block_encoder` whether one is
there. Without it a store encodes with its codecs in PyTorch, as on the CPU.
"""

from __future__ import annotations

from collections.abc import Callable

_ENCODER: list[Callable] = []


def provide_block_encoder(encoder: Callable) -> None:
    """Register ``encoder(k16, v16, group) -> (key_blocks, value_blocks, eta, nu)``: INT8 keys
    per channel and INT4 values per group of blocks ``[Hkv, n, B, d]`` in one launch."""
    _ENCODER[:] = [encoder]


def block_encoder() -> Callable | None:
    """The registered fused block encoder, or None."""
    return _ENCODER[0] if _ENCODER else None
