"""KVQuantizer: the ``quantizer`` config group -> the precisions a layer's blocks are held at.

A completed block of ``B`` tokens is held at one :class:`Precision` (a key codec and a value
codec; FP16 for an exact window). Its **age** is the number of tokens appended after it,
``N - (b + 1) B`` for block ``b`` of a sequence of ``N`` tokens. A quantizer lists *stages* by
age: a block enters stage ``i`` once its age reaches ``stage_ages()[i - 1]`` and is then
re-quantized from its FP16 originals (Tier-2) at ``stage_precision(i, N)``. The first
``sink`` tokens' blocks stay exact.

* :class:`KVQuantizer`: one lossy precision, after an optional exact ``residual`` window (KIVI's
  residual: the newest ``residual`` tokens in FP16).
* :class:`~certkv.quant.tiers.TieredQuantizer`: seed 004's hot / warm / archive tiers.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, replace

from certkv.errors import ConfigError, require
from certkv.quant.base import KeyCodec, ValueCodec
from certkv.quant.fp16 import FP16KeyCodec, FP16ValueCodec
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.int8_channel import ChannelAffineKeyCodec
from certkv.quant.precision import Precision, exact_precision
from certkv.quant.protect.protection import Protection
from certkv.registry import QUANTIZERS


def _non_negative(name: str, value) -> None:
    require(isinstance(value, int) and not isinstance(value, bool) and value >= 0, ConfigError,
            f"{name}={value!r} must be a non-negative integer number of tokens, e.g. 0.")


@QUANTIZERS.register("kv")
@dataclass
class KVQuantizer:
    """How Tier-1 stores a layer: ``key_codec``, ``value_codec`` and ``block_size`` B.

    Args:
        residual: the newest ``residual`` tokens' blocks stay FP16 (exact); 0 quantizes every
            completed block at once (the paper's setting; the partial tail block is always exact).
        sink: the first ``sink`` tokens' blocks stay FP16 for the whole sequence.
        budget_bytes: a Tier-1 budget per layer (codes, metadata and exact windows of completed
            blocks); ``None``: none. Over ``memory_threshold * budget_bytes`` after a step, the
            oldest blocks not yet at the last stage graduate to it early; a store that still
            exceeds the budget raises :class:`~certkv.errors.BudgetError`.
        memory_threshold: the fraction of the budget at which early graduation starts (seed
            004's ``memory_threshold``, 0.9).
        protection: error-correcting codes, the integrity check and injected faults over the
            lossy precisions' codes (the ``protect`` config group, set by
            :meth:`with_protection`); None: none.
        eviction: the eviction policy (the ``evict`` config group, :mod:`certkv.evict`, set by
            :meth:`with_eviction`): evicted blocks are held at their summary only; None: none.
    """

    key_codec: KeyCodec = field(default_factory=ChannelAffineKeyCodec)
    value_codec: ValueCodec = field(default_factory=GroupAffineValueCodec)
    block_size: int = 16
    residual: int = 0
    sink: int = 0
    budget_bytes: int | None = None
    memory_threshold: float = 0.9
    protection: Protection | None = None
    eviction: object = None

    def __post_init__(self) -> None:
        require(isinstance(self.block_size, int) and self.block_size >= 1, ConfigError,
                f"block_size={self.block_size!r} must be a positive integer, e.g. 16.")
        _non_negative("residual", self.residual)
        _non_negative("sink", self.sink)
        require(self.budget_bytes is None or (isinstance(self.budget_bytes, int)
                                              and self.budget_bytes > 0), ConfigError,
                f"budget_bytes={self.budget_bytes!r} must be a positive number of bytes or "
                "null (no budget).")
        require(0 < self.memory_threshold <= 1, ConfigError,
                f"memory_threshold={self.memory_threshold!r} must be in (0, 1], e.g. 0.9.")

    @classmethod
    def fp16(cls, block_size: int = 16) -> KVQuantizer:
        """FP16 passthrough in Tier-1: what the dense mode and the shared dense prefill use
        (they read only FP16 originals, so no quantization work is done)."""
        return cls(FP16KeyCodec(), FP16ValueCodec(), block_size)

    def for_mode(self, mode: str) -> KVQuantizer:
        """The quantizer a cache in attention ``mode`` uses: FP16 passthrough for ``dense`` (it
        reads only FP16 originals, kept on the device), this one otherwise."""
        return KVQuantizer.fp16(self.block_size) if mode == "dense" else self

    def with_protection(self, protection: Protection | None) -> KVQuantizer:
        """This quantizer with ``protection`` (``self`` when it changes nothing)."""
        if protection is None or not protection.enabled:
            return self if self.protection is None else replace(self, protection=None)
        return replace(self, protection=protection)

    def with_eviction(self, policy) -> KVQuantizer:
        """This quantizer with eviction ``policy`` (``self`` when it changes nothing)."""
        if policy is None or not policy.enabled:
            return self if self.eviction is None else replace(self, eviction=None)
        return replace(self, eviction=policy)

    # ---------------------------------------------------------------- stages
    def precisions(self) -> list[Precision]:
        """Every precision a block may be held at; id 0 is the exact window's."""
        return [exact_precision(), Precision(self.key_codec, self.value_codec, "quantized")]

    def stage_ages(self) -> list[int]:
        """The age at which a block enters each stage after the first (ascending)."""
        return [self.residual] if self.residual else []

    def stage_precision(self, stage: int, seq_len: int) -> int:
        """The precision id of a block entering ``stage`` when the sequence holds ``seq_len``
        tokens."""
        return 0 if self.residual and stage == 0 else 1

    def observe(self, certificate, layer: int | None = None) -> None:
        """Hook for quantizers that adapt to the measured certificates (none here)."""

    def may_hold(self, pid: int) -> bool:
        """Whether a block may ever be held at precision ``pid`` (of :meth:`precisions`); only
        those must be storable (validated, e.g. under an error-correcting code)."""
        return True

    def validate(self, head_dim: int) -> None:
        """Fail (one sentence naming the fix) if a layer of ``head_dim`` cannot be stored."""
        for pid, precision in enumerate(self.precisions()):
            if self.may_hold(pid):
                precision.validate(head_dim, self.block_size)

    def store_kwargs(self) -> dict:
        """Keyword arguments for ``TieredKVStore``."""
        return {"block_size": self.block_size, "quantizer": self}

    def codecs(self) -> list:
        """Every codec this quantizer may store a block with."""
        return [c for p in self.precisions() for c in (p.key_codec, p.value_codec)]

    def with_rope(self, rope) -> KVQuantizer:
        """A copy whose position-dependent codecs (pre-RoPE keys: those with a ``rope`` field)
        know the model's rotary embedding ``rope`` (:class:`certkv.quant.rope.RopeSpec`);
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
