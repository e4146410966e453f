"""transformers' own quantized KV cache as a baseline (issue 57): ``mode: hf_quantized``.

A variant ``{name: hf-quanto4, mode: hf_quantized, hf_cache: {nbits: 4}}`` decodes with Hugging
Face's :class:`transformers.QuantizedCache` (KIVI-style: per-channel groups of ``q_group_size``,
the newest up to ``residual_length`` tokens in full precision, re-quantized whenever that window
fills) run by transformers' and the backend's own code, after the same dense prefill as every
other method (its prefill states are the cache's first update, which quantizes them all). The
model's own attention (SDPA) reads it; nothing is certified and no certificate is recorded: it
sits in the tables beside certkv's ``kivi2`` / ``kivi4``, naive and certified, on the same
prompts.

The ``quanto`` backend needs ``optimum-quanto`` (``pip install 'certkv[hf-quantized]'``; it
takes 2 and 4 bits); ``hqq`` needs ``hqq``. Such a cache cannot be joined with others into one
batch (its quantized states are not left-padded), so its requests decode one at a time.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require, require_known

MODE = "hf_quantized"
PACKAGES = {"quanto": "optimum.quanto", "hqq": "hqq"}
BITS = {"quanto": (2, 4), "hqq": (1, 2, 3, 4, 8)}


@dataclass(frozen=True)
class HFQuantized:
    """A :class:`transformers.QuantizedCache` configuration (its own argument names)."""

    backend: str = "quanto"
    nbits: int = 4
    q_group_size: int = 64
    residual_length: int = 128

    def __post_init__(self) -> None:
        require(self.backend in PACKAGES, ConfigError,
                f"hf_cache.backend={self.backend!r} is unknown; use one of {list(PACKAGES)}.")
        require(self.nbits in BITS[self.backend], ConfigError,
                f"hf_cache.nbits={self.nbits!r} is not a width the {self.backend} backend takes; "
                f"use one of {list(BITS[self.backend])}.")
        for name in ("q_group_size", "residual_length"):
            value = getattr(self, name)
            require(isinstance(value, int) and value > 0, ConfigError,
                    f"hf_cache.{name}={value!r} must be a positive integer.")

    @classmethod
    def from_config(cls, node: dict | None) -> HFQuantized:
        """From a variant's ``hf_cache`` mapping (unknown keys are one sentence)."""
        node = dict(node or {})
        require_known(node, cls.__dataclass_fields__, "hf_cache")
        return cls(**node)

    @property
    def label(self) -> str:
        return f"HF QuantizedCache ({self.backend}, {self.nbits}-bit, " \
               f"group {self.q_group_size}, residual {self.residual_length})"

    def check_installed(self) -> None:
        """One sentence naming the fix where the backend's package is missing."""
        module = PACKAGES[self.backend]
        require(importlib.util.find_spec(module.split(".")[0]) is not None, ConfigError,
                f"mode=hf_quantized with backend={self.backend} needs the {module} package; "
                "install it with pip install 'certkv[hf-quantized]' (quanto) or pip install "
                "hqq.")

    def cache(self, config, states: list[tuple[torch.Tensor, torch.Tensor] | None]):
        """A fresh cache for a model of ``config`` holding the prefill ``states`` (per layer
        ``(keys, values)`` ``[1, Hkv, T, d]``, cloned: a session's caches never share them)."""
        from transformers import QuantizedCache

        self.check_installed()
        cache = QuantizedCache(self.backend, config, nbits=self.nbits,
                               q_group_size=self.q_group_size,
                               residual_length=self.residual_length)
        with torch.inference_mode():
            for i, state in enumerate(states):
                if state is not None:
                    cache.update(state[0].clone(), state[1].clone(), i)
        return cache


def joinable(cache) -> bool:
    """Whether ``cache`` can join others in one batch (not a quantized HF cache)."""
    from transformers import QuantizedCache

    return not isinstance(cache, QuantizedCache)


def quantized_bytes(cache) -> tuple[int, int]:
    """``(bytes held, FP16 bytes of the same tokens)`` of a quanto :class:`QuantizedCache`:
    every layer's packed codes, scales and shifts plus its full-precision residual window,
    against keys and values of all its tokens in FP16 (what ``T1 / FP16`` means for certkv)."""
    held = dense = 0
    for layer in cache.layers:
        tokens = layer.cumulative_length if layer.is_initialized else 0
        for packed in (layer._quantized_keys, layer._quantized_values):
            for name in ("_data", "_scale", "_shift"):
                part = getattr(packed, name)
                part = getattr(part, "_data", part)  # the packed bits behind a bit tensor
                held += part.numel() * part.element_size()
        for full in (layer.keys, layer.values):
            held += full.numel() * full.element_size()
        heads, dim = layer._quantized_keys.shape[1], layer._quantized_keys.shape[-1]
        dense += 2 * tokens * heads * dim * 2
    return held, dense

