"""The ``protect`` config group: which code guards Tier-1's codes, and which faults hit them.

:class:`Protection` names a code (``none``, ``hamming74``, ``hamming84``, ``golay24``), how
erasures are repaired, whether the per-block integrity check is stored, and a
:class:`FaultModel`: the binary symmetric channel of seed 003 (every stored bit flips with
probability ``p``) over the code words of quantized blocks (parity bits included; scales,
offsets and the check too with ``metadata``). A lossy block's FP16 side (``int8_fp16``'s values)
is its words; an evicted block's summary is metadata. Faults are persistent by default (drawn
once, when a block is written to Tier-1, as a memory fault; every later read sees the same bits)
or transient (``transient``: drawn anew on every read, the stored bits stay clean). Exact FP16
windows are not faulted (the seed protects quantized codes). The store applies both
(:class:`~certkv.cache.store.TieredKVStore`).

Which stored tensors the integrity check covers: all of a lossy block's (codes or FP16 side,
scales, offsets, bias: :class:`~certkv.quant.protect.codec.ProtectedCodec`) and an evicted
block's summary (:class:`~certkv.quant.protect.checked.CheckedCodec`). Without it, faults can
make what a step reads differ from what was written in ways no bound states: the certificate
then says it does not cover faults (:attr:`Protection.covers_faults`).

The blocks' annotations (``eta``, ``nu``, ... : the words of each block the certificate reads)
flip with ``metadata`` where the integrity check can see them: a block whose annotations fail
their hash is served from its FP16 originals with its originals' annotations
(:meth:`~certkv.cache.store.TieredKVStore._notes_fail_check`). The store's other state (running
maxima, block table, counts) is not in the fault model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import Blocks
from certkv.quant.protect.base import Code
from certkv.quant.protect.checked import CheckedCodec, CheckedKeyCodec, CheckedValueCodec
from certkv.quant.protect.codec import (
    ERASURES,
    ProtectedCodec,
    ProtectedKeyCodec,
    ProtectedValueCodec,
)
from certkv.quant.protect.faults import check_rate, inject
from certkv.registry import PROTECTION_CODES


@dataclass
class FaultModel:
    """Bit flips at rate ``p`` (seeded) on stored codes; see the module docstring."""

    p: float = 0.0
    seed: int = 0
    transient: bool = False
    metadata: bool = False

    def __post_init__(self) -> None:
        self.p = check_rate(self.p)
        require(isinstance(self.seed, int) and not isinstance(self.seed, bool), ConfigError,
                f"faults.seed={self.seed!r} must be an integer, e.g. 0.")

    @property
    def active(self) -> bool:
        return self.p > 0

    def generator(self, layer: int) -> torch.Generator:
        """The flips' generator of one layer's store (seeded by ``seed`` and the layer)."""
        return torch.Generator().manual_seed(self.seed * 1_000_003 + layer)

    def flip(self, blocks: Blocks, generator: torch.Generator) -> tuple[Blocks, int]:
        """``blocks`` with the faulted tensors' bits flipped at rate ``p``, and how many bits
        flipped: the code words (``ecc``, or ``codes`` unprotected), and with ``metadata`` every
        other tensor."""
        words = next((name for name in ("ecc", "codes", "data") if name in blocks), None)
        out, flipped = dict(blocks), 0
        for name, t in blocks.items():
            if name == words or (self.metadata and name != words):
                out[name], n = inject(t, self.p, generator)
                flipped += n
        return out, flipped


@dataclass
class Protection:
    """How Tier-1's quantized codes are protected (``protect`` config group).

    Args:
        code: ``none``, ``hamming74`` (7 bits per 4-bit value, corrects one error per word),
            ``hamming84`` (SECDED, 8 bits: a double error is an erasure), ``golay24`` (three
            values per 24-bit word: corrects up to 3 errors, flags 4).
        erasure: ``zero`` or ``interp`` (the seed's midpoint of neighbouring tokens).
        integrity: store a per-block hash and serve blocks that fail it from their FP16
            originals (what keeps the certificate valid under faults).
        faults: the injected faults (:class:`FaultModel`).
    """

    code: str = "none"
    erasure: str = "zero"
    integrity: bool = False
    faults: FaultModel = field(default_factory=FaultModel)

    def __post_init__(self) -> None:
        PROTECTION_CODES.get(self.code, label="protect.code")  # one sentence if unknown
        require(self.erasure in ERASURES, ConfigError,
                f"protect.erasure={self.erasure!r} is unknown; use one of {list(ERASURES)}.")
        if isinstance(self.faults, dict):
            self.faults = FaultModel(**self.faults)

    @property
    def wraps(self) -> bool:
        """Codecs are wrapped (a code or the integrity check is on)."""
        return self.code != "none" or self.integrity

    @property
    def covers_faults(self) -> bool:
        """Whether every bit the fault model can flip is covered by the integrity check (or
        none flips): only then do the codecs' bounds hold for what a step reads."""
        return self.integrity or not self.faults.active

    @property
    def enabled(self) -> bool:
        """Anything differs from an unprotected, fault-free store."""
        return self.wraps or self.faults.active

    def wrap(self, precision):
        """``precision`` with its codecs protected (exact ones unchanged): codecs that store
        codes under the code (and the check), the others (FP16 sides, eviction summaries:
        ``stores_codes`` False) under the integrity check alone, when it is on."""
        from certkv.quant.precision import Precision

        if precision.exact or not self.wraps:
            return precision
        code = PROTECTION_CODES.get(self.code)()

        def wrapped(codec, protected_kind, checked_kind):
            if codec.stores_codes:
                return protected_kind(codec, code, self.erasure, self.integrity)
            return checked_kind(codec) if self.integrity else codec

        return Precision(wrapped(precision.key_codec, ProtectedKeyCodec, CheckedKeyCodec),
                         wrapped(precision.value_codec, ProtectedValueCodec, CheckedValueCodec),
                         precision.name)

    @property
    def bits_per_value(self) -> float:
        """Stored bits per 4-bit value (4 unprotected)."""
        return bits_per_value(self.code)


def bits_per_value(code: str) -> float:
    """Stored bits per 4-bit value of the code named ``code`` (4 for ``none``)."""
    make = PROTECTION_CODES.get(code)
    return make.word_bits / make.values_per_word


@PROTECTION_CODES.register("none")
class _Identity(Code):
    """No code (integrity check alone): 4-bit words stored as they are, never corrected."""

    name = "none"
    word_bits = 4

    def __init__(self) -> None:
        self._data = torch.arange(16)  # the decode table (the Triton path looks words up)

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        return data

    def decode(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return words, torch.zeros_like(words, dtype=torch.uint8)


def protected(codec) -> ProtectedCodec | CheckedCodec | None:
    """``codec`` if it is protected or checked (it has a :meth:`read`), else None."""
    return codec if isinstance(codec, (ProtectedCodec, CheckedCodec)) else None
