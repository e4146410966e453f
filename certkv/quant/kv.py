"""KVQuantizer: the ``quantizer`` config group -> key codec, value codec and block size."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from certkv.errors import ConfigError, require
from certkv.quant.base import KeyCodec, ValueCodec
from certkv.quant.fp16 import FP16KeyCodec, FP16ValueCodec
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import ChannelAffineKeyCodec


@dataclass
class KVQuantizer:
    """How Tier-1 stores a layer: ``key_codec``, ``value_codec`` and ``block_size`` B."""

    key_codec: KeyCodec = field(default_factory=ChannelAffineKeyCodec)
    value_codec: ValueCodec = field(default_factory=GroupAffineValueCodec)
    block_size: int = 16

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size >= 1, ConfigError,
                f"block_size={self.block_size!r} must be a positive integer, e.g. 16.")

    @classmethod
    def fp16(cls, block_size: int = 16) -> KVQuantizer:
        """FP16 passthrough in Tier-1: what the dense mode and the shared dense prefill use
        (they read only FP16 originals, so no quantization work is done)."""
        return cls(FP16KeyCodec(), FP16ValueCodec(), block_size)

    def for_mode(self, mode: str) -> KVQuantizer:
        """The quantizer a cache in attention ``mode`` uses: FP16 passthrough for ``dense`` (it
        reads only FP16 originals, kept on the device), this one otherwise."""
        return KVQuantizer.fp16(self.block_size) if mode == "dense" else self

    def validate(self, head_dim: int) -> None:
        """Fail (one sentence naming the fix) if a layer of ``head_dim`` cannot be stored."""
        self.key_codec.validate(head_dim, self.block_size)
        self.value_codec.validate(head_dim, self.block_size)

    def store_kwargs(self) -> dict:
        """Keyword arguments for ``TieredKVStore``."""
        return {"block_size": self.block_size, "key_codec": self.key_codec,
                "value_codec": self.value_codec}

    def codecs(self) -> list:
        """Every codec this quantizer may store a block with."""
        return [self.key_codec, self.value_codec]

    def with_rope(self, rope) -> KVQuantizer:
        """A copy whose position-dependent codecs (pre-RoPE keys: those with a ``rope`` field)
        know the model's rotary embedding ``rope`` (:class:`certkv.models.rope.RopeSpec`);
        ``self`` when no codec needs it."""
        if not any(hasattr(c, "rope") for c in self.codecs()):
            return self
        new = copy.deepcopy(self)
        for codec in new.codecs():
            if hasattr(codec, "rope"):
                codec.rope = rope
        return new

    @property
    def label(self) -> str:
        return f"K{self.key_codec.bits}/V{self.value_codec.bits}"
