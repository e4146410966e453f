"""TieredQuantizer: seed 004's three tiers by age, each block certified at its own precision.

* **hot**: age ``< hot`` (64), FP16: exact blocks (no Delta, no eta);
* **warm**: ``hot <= age < stale`` (512), ``key_codec`` / ``value_codec`` (4-bit KIVI);
* **archive**: age ``>= stale``, at the archive precision chosen when the block graduates: a
  fixed choice (``archive: kivi2 | rotation | kvquant``) or ``auto``, the seed's choice by
  sequence length (``kivi2`` below ``mid_from`` = 2048 tokens, ``rotation`` up to
  ``long_from`` = 8192, ``kvquant`` from there). Blocks already archived keep their codec.

Ages count tokens after a block (:mod:`certkv.quant.kv`); blocks graduate whole, re-quantized
from their FP16 originals (never from their codes). The boundaries ``hot`` and ``stale`` may
move at run time by the measured certificates (:class:`~certkv.cache.thresholds.
AdaptiveThresholds`, :attr:`adaptive`), applied to blocks that graduate from then on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from certkv.errors import ConfigError, require
from certkv.quant.int4_group import GroupAffineValueCodec
from certkv.quant.kivi import KiviKeyCodec
from certkv.quant.kv import KVQuantizer
from certkv.quant.precision import Precision, exact_precision
from certkv.registry import QUANTIZERS

ARCHIVES = ("kivi2", "rotation", "kvquant")


def _kivi(bits: int) -> Precision:
    return Precision(KiviKeyCodec(bits=bits), GroupAffineValueCodec(bits=bits, group=32))


@QUANTIZERS.register("tiers")
@dataclass
class TieredQuantizer(KVQuantizer):
    """Hot / warm / archive tiers (seed 004); ``key_codec`` / ``value_codec`` are the warm
    tier's. ``archives`` maps each archive name of :data:`ARCHIVES` to its precision (the
    config gives all three); ``adaptive`` holds the limits of the certificate-driven
    boundaries, or None for fixed ones."""

    key_codec: object = field(default_factory=lambda: KiviKeyCodec(bits=4))
    value_codec: object = field(default_factory=lambda: GroupAffineValueCodec(bits=4, group=32))
    block_size: int = 32
    hot: int = 64
    stale: int = 512
    archive: str = "auto"
    mid_from: int = 2048
    long_from: int = 8192
    archives: dict = field(default_factory=lambda: {name: _kivi(2) for name in ARCHIVES})
    adaptive: object = None

    def __post_init__(self) -> None:
        super().__post_init__()
        require(self.residual == 0, ConfigError,
                "a tiered quantizer's exact window is its hot tier; set hot, not residual.")
        require(isinstance(self.hot, int) and isinstance(self.stale, int)
                and 0 <= self.hot <= self.stale, ConfigError,
                f"tier boundaries hot={self.hot!r}, stale={self.stale!r} must be integers with "
                "0 <= hot <= stale (ages in tokens, e.g. 64 and 512).")
        require(self.archive in ("auto", *ARCHIVES), ConfigError,
                f"archive={self.archive!r} is unknown; use auto or one of {list(ARCHIVES)}.")
        missing = [name for name in ARCHIVES if name not in self.archives]
        require(not missing, ConfigError,
                f"archives lacks {missing}; give a precision for each of {list(ARCHIVES)}.")
        require(0 < self.mid_from <= self.long_from, ConfigError,
                f"mid_from={self.mid_from!r}, long_from={self.long_from!r} must satisfy "
                "0 < mid_from <= long_from (sequence lengths, e.g. 2048 and 8192).")

    def precisions(self) -> list[Precision]:
        """``exact`` (hot and sinks), ``warm``, then one per archive name (ids 2, 3, 4)."""
        archived = []
        for name in ARCHIVES:
            p = self.archives[name]
            archived.append(Precision(p.key_codec, p.value_codec, f"archive-{name}"))
        return [exact_precision(), Precision(self.key_codec, self.value_codec, "warm"),
                *archived]

    def stage_ages(self) -> list[int]:
        return [self.hot, self.stale]

    def may_hold(self, pid: int) -> bool:
        """Exact and warm, and the archives :meth:`archive_for` can choose (a fixed archive: only
        it, so protection codes compose with ``archive=kivi2`` or ``rotation``)."""
        return pid < 2 or self.archive == "auto" or pid == 2 + ARCHIVES.index(self.archive)

    def archive_for(self, seq_len: int) -> str:
        """The archive a block graduating at ``seq_len`` tokens gets."""
        if self.archive != "auto":
            return self.archive
        if seq_len < self.mid_from:
            return "kivi2"
        return "rotation" if seq_len < self.long_from else "kvquant"

    def stage_precision(self, stage: int, seq_len: int) -> int:
        if stage == 0:  # hot: exact (with hot = 0 no block stays in stage 0)
            return 0
        if stage == 1:
            return 1
        return 2 + ARCHIVES.index(self.archive_for(seq_len))

    @property
    def label(self) -> str:
        return f"tiers(hot<{self.hot}, K{self.key_codec.bits}/V{self.value_codec.bits}, " \
               f"archive {self.archive})"
