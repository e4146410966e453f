"""A precision: the key codec and value codec one block is held at in Tier-1."""

from __future__ import annotations

from dataclasses import dataclass, field

from certkv.quant.base import KeyCodec, ValueCodec
from certkv.quant.fp16 import FP16KeyCodec, FP16ValueCodec
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import ChannelAffineKeyCodec


@dataclass
class Precision:
    """A key codec and a value codec: how one block is held in Tier-1."""

    key_codec: KeyCodec = field(default_factory=ChannelAffineKeyCodec)
    value_codec: ValueCodec = field(default_factory=GroupAffineValueCodec)
    name: str = ""

    @property
    def exact(self) -> bool:
        """FP16 keys and values: the block enters the certificate as exact (no Delta, no eta)."""
        return self.key_codec.exact and self.value_codec.exact

    @property
    def label(self) -> str:
        return "FP16" if self.exact else f"K{self.key_codec.bits}/V{self.value_codec.bits}"

    def validate(self, head_dim: int, block_size: int) -> None:
        self.key_codec.validate(head_dim, block_size)
        self.value_codec.validate(head_dim, block_size)


def exact_precision() -> Precision:
    return Precision(FP16KeyCodec(), FP16ValueCodec(), "exact")
