"""NVIDIA kvpress's presses as baselines (issue 57): ``mode: kvpress`` and its settings.

A variant ``{name: kvpress-snapkv-25, mode: kvpress, press: {press: SnapKVPress,
compression_ratio: 0.75, options: {window_size: 32}}}`` is answered by kvpress's own code in
its own venv; :mod:`certkv.eval.kvpress_exchange` says how the two processes meet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from certkv.errors import ConfigError, require, require_known

MODE = "kvpress"
_PRESS_NAME = re.compile(r"^[A-Z][A-Za-z0-9]*Press$")


@dataclass(frozen=True)
class KVPress:
    """A kvpress press: its class name in kvpress (``SnapKVPress``, ``StreamingLLMPress``,
    ``KnormPress``, ``ExpectedAttentionPress``, ...), its ``compression_ratio`` (the share of
    the prompt's tokens it removes) and its other constructor arguments (``options``, e.g.
    ``{window_size: 32}``)."""

    press: str = "SnapKVPress"
    compression_ratio: float = 0.5
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(isinstance(self.press, str) and bool(_PRESS_NAME.match(self.press)),
                ConfigError,
                f"press.press={self.press!r} is not a kvpress class name; use one such as "
                "SnapKVPress, StreamingLLMPress, KnormPress or ExpectedAttentionPress.")
        ratio = self.compression_ratio
        require(isinstance(ratio, (int, float)) and not isinstance(ratio, bool)
                and 0.0 <= ratio < 1.0, ConfigError,
                f"press.compression_ratio={ratio!r} must lie in [0, 1) (the share of the "
                "prompt's tokens the press removes); e.g. 0.75 keeps a quarter.")
        require(isinstance(self.options, dict)
                and all(isinstance(v, (int, float, str, bool)) for v in self.options.values()),
                ConfigError,
                f"press.options={self.options!r} must map the press's argument names to "
                "numbers, strings or booleans; e.g. {window_size: 32}.")

    @classmethod
    def from_config(cls, node: dict | None) -> KVPress:
        """From a variant's ``press`` mapping (unknown keys are one sentence)."""
        node = dict(node or {})
        require_known(node, cls.__dataclass_fields__, "press",
                      " (the press's own arguments go in options)")
        return cls(**{**node, "options": dict(node.get("options") or {})})

    @property
    def label(self) -> str:
        extra = "".join(f", {k} {v}" for k, v in sorted(self.options.items()))
        return f"kvpress {self.press} (compression {self.compression_ratio:g}{extra})"
