"""Checked codecs: the integrity check alone, for stored tensors that are not 4-bit codes.

An error-correcting code protects a codec's 4-bit aligned ``codes``
(:mod:`certkv.quant.protect.codec`). Two kinds of blocks a certified step reads from Tier-1
store none: the FP16 side of a lossy precision (``int8_fp16``'s values) and an evicted block's
summary (per-channel ranges, a centre and a radius: :mod:`certkv.quant.summary`). Under the
fault model their stored bits flip like any other; a flipped exponent bit is an arbitrary error
that no bound of the codec states. With ``protect.integrity`` on, a checked codec stores
:func:`~certkv.quant.protect.integrity.block_hash` of every tensor of the block (``check``) and
a read that fails it marks the block corrupted: the store serves it from its FP16 originals,
as it does for a protected codec's block. Nothing is corrected or erased.
"""

from __future__ import annotations

import torch

from certkv.quant.base import Blocks
from certkv.quant.protect.codec import BlockRead, WrappedKeyCodec, WrappedValueCodec
from certkv.quant.protect.integrity import block_hash


class CheckedCodec:
    """The shared part of :class:`CheckedKeyCodec` and :class:`CheckedValueCodec`: ``inner``'s
    blocks plus ``check`` ``[Hkv, n, 2]`` (int32), verified on every read."""

    integrity = True

    def __init__(self, inner):
        self.inner = inner
        self.bits = inner.bits
        self.name = f"{inner.name}+check"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and self.inner == other.inner

    __hash__ = None

    def validate(self, head_dim: int, block_size: int) -> None:
        self.inner.validate(head_dim, block_size)

    def stored_layout(self, block_size: int, head_dim: int) -> Blocks:
        return self._stored(self.inner.stored_layout(block_size, head_dim))

    @staticmethod
    def _stored(blocks: Blocks) -> Blocks:
        return {**blocks, "check": block_hash(blocks)}

    def inner_blocks(self, blocks: Blocks) -> Blocks:
        """The inner codec's blocks as read (``check`` left out)."""
        return {name: t for name, t in blocks.items() if name != "check"}

    def read(self, blocks: Blocks) -> BlockRead:
        """Whether each block ``[Hkv, n]`` reads back as written (no words to correct)."""
        intact = (block_hash(self.inner_blocks(blocks)) == blocks["check"]).all(dim=-1)
        zeros = torch.zeros(intact.shape, dtype=torch.int64, device=intact.device)
        return BlockRead(zeros, zeros, intact)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return self.inner.decode(self.inner_blocks(blocks))


class CheckedKeyCodec(CheckedCodec, WrappedKeyCodec):
    """A key codec whose blocks carry the integrity check; bounds are the inner codec's."""


class CheckedValueCodec(CheckedCodec, WrappedValueCodec):
    """A value codec whose blocks carry the integrity check; bounds are the inner codec's."""
