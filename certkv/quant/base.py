"""Codec interface: an FP16 block -> packed codes + metadata + a deterministic error bound.

A codec turns blocks ``[Hkv, n, B, d]`` of FP16 originals into a dict of tensors whose leading
dimensions are ``[Hkv, n]`` (codes and metadata, everything that lives in Tier-1). Byte accounting
is the sum of those tensors' sizes, so it is exact by construction.

Certification only needs one promise from a codec (paper 4.6, precondition P2):

* key codecs bound the reconstruction error per channel: ``|k - k_hat| <= channel_bound`` for every
  token of the block, which gives Delta_b (eq. 8);
* value codecs bound it per token in l2: ``||v - v_hat||_2 <= token_bound``; the store additionally
  measures the achieved per-token error exactly at write time (eta_b, Corollary 4.2).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import NamedTuple

import torch

from certkv.quant.layout import CodeLayout

Blocks = dict[str, torch.Tensor]
"""Codes and metadata of ``n`` blocks; every tensor has leading dimensions ``[Hkv, n]``."""

FP32_EPS = 2.0**-24  # unit roundoff of float32


class LayerContext(NamedTuple):
    """What the store knows about a layer beyond the blocks it encodes (for codecs that use it).

    Attributes:
        key_max: FP32 ``[Hkv, d]`` channel maximum of ``|k|`` over the layer's first append (the
            prefill), or None before it (InnerQ's key normalization, seed 002 Section 4.3).
        prefill: the blocks are being quantized during the first append (InnerQ's
            ``hybrid_prefill`` mode), not later in decode.
    """

    key_max: torch.Tensor | None = None
    prefill: bool = False


def round_up_fp16(x: torch.Tensor) -> torch.Tensor:
    """Cast an FP32 tensor to FP16, rounding up (any sign) so a scale or a maximum never
    shrinks."""
    y = x.to(torch.float16)
    low = y.float() < x
    return torch.where(low, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def round_down_fp16(x: torch.Tensor) -> torch.Tensor:
    """Cast an FP32 or FP64 tensor (``|x| <= 65504``) to FP16, rounding down so a minimum never
    grows."""
    y = x.to(torch.float16)
    high = y.double() > x
    return torch.where(high, torch.nextafter(y, torch.full_like(y, float("-inf"))), y)


def round_up_fp32(x: torch.Tensor) -> torch.Tensor:
    """Cast an FP64 tensor to FP32, rounding up so a bound is never below the exact value."""
    y = x.float()
    return torch.where(y.double() < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


class KeyCodec(ABC):
    """Quantizes key blocks; states a per-channel reconstruction bound (paper 2.3, eq. 2-3)."""

    name: str = "key"
    bits: int = 16
    stores_codes = True  # a ``codes`` tensor an error-correcting code can protect (FP16
    # passthrough and eviction summaries store none: only the integrity check covers them)
    exact = False  # decodes to the FP16 originals bit for bit (no Delta_b: an exact window)

    def validate(self, head_dim: int, block_size: int) -> None:  # noqa: B027 - optional hook
        """Raise a ConfigError if this codec cannot handle the given shapes."""

    def kernel_layout(self) -> CodeLayout | None:
        """How the fused kernels read this codec's blocks, or None: the PyTorch reference
        decodes them (:mod:`certkv.quant.layout`; a subclass that changes the encoding
        returns None unless it claims a layout of its own)."""
        return None

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored blocks as the kernels read them under :meth:`kernel_layout`."""
        return blocks

    @abstractmethod
    def encode(self, k: torch.Tensor) -> Blocks:
        """FP16 keys ``[Hkv, n, B, d]`` -> codes and metadata (leading dims ``[Hkv, n]``)."""

    def stored_layout(self, block_size: int, head_dim: int) -> Blocks:
        """What one block of zeros is stored as (codes and metadata ``[1, 1, ...]``): how a
        wrapper (protection) learns the layout of the codes it covers. Codecs that cannot
        :meth:`encode` without more context (pre-RoPE keys: positions) answer for what they
        store."""
        return self.encode(torch.zeros(1, 1, block_size, head_dim, dtype=torch.float16))

    def encode_at(self, k: torch.Tensor, start: torch.Tensor,
                  layer: LayerContext | None = None) -> Blocks:
        """:meth:`encode` for blocks whose first tokens sit at sequence positions ``start [n]``
        (int64; the store passes them for every block) in a layer described by ``layer``. Codecs
        that depend on the position (pre-RoPE keys) or the layer (InnerQ) override this; the
        others ignore both."""
        return self.encode(k)

    def check_encodable(self, k: torch.Tensor, start: torch.Tensor) -> None:  # noqa: B027
        """Raise (one sentence naming the fix) if FP16 keys ``[Hkv, n, B, d]`` of blocks that
        start at ``start [n]`` cannot be encoded: the store asks every precision a block may be
        held at before an append changes anything, so a block is never refused later, when it
        graduates. Every block can be encoded unless a codec says otherwise."""

    @abstractmethod
    def decode(self, blocks: Blocks) -> torch.Tensor:
        """Codes and metadata -> FP32 keys ``[Hkv, n, B, d]``."""

    @abstractmethod
    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        """FP32 ``[Hkv, n, d]``: ``max_t |k[t, c] - k_hat[t, c]|`` is at most this, per channel."""

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        """FP32 ``[Hkv, n, d]``: any FP32 evaluation of :meth:`decode` (a fused kernel's in
        registers included, FMA or not) is within this of this codec's own decode, per channel
        and token. The store measures key-error annotations on its own decode and adds this, so
        they bound the error of the keys the kernels actually use. 0 for exact decoders."""
        return torch.zeros_like(self.channel_bound(blocks))


class ValueCodec(ABC):
    """Quantizes value blocks; states a per-token l2 reconstruction bound."""

    name: str = "value"
    bits: int = 16
    stores_codes = True  # see KeyCodec.stores_codes
    exact = False  # see KeyCodec.exact

    def validate(self, head_dim: int, block_size: int) -> None:  # noqa: B027 - optional hook
        """Raise a ConfigError if this codec cannot handle the given shapes."""

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """How the fused kernels read this codec's blocks at ``head_dim``, or None (see
        :meth:`KeyCodec.kernel_layout`)."""
        return None

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored blocks as the kernels read them under :meth:`kernel_layout`."""
        return blocks

    @abstractmethod
    def encode(self, v: torch.Tensor) -> Blocks:
        """FP16 values ``[Hkv, n, B, d]`` -> codes and metadata (leading dims ``[Hkv, n]``)."""

    def stored_layout(self, block_size: int, head_dim: int) -> Blocks:
        """What one block of zeros is stored as (see :meth:`KeyCodec.stored_layout`)."""
        return self.encode(torch.zeros(1, 1, block_size, head_dim, dtype=torch.float16))

    def encode_at(self, v: torch.Tensor, layer: LayerContext | None = None) -> Blocks:
        """:meth:`encode` in a layer described by ``layer`` (what the store calls; only codecs
        that depend on the layer, such as InnerQ's ``hybrid_prefill``, override it)."""
        return self.encode(v)

    @abstractmethod
    def decode(self, blocks: Blocks) -> torch.Tensor:
        """Codes and metadata -> FP32 values ``[Hkv, n, B, d]``."""

    @abstractmethod
    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        """FP32 ``[Hkv, n, B]`` a-priori bound on ``||v_t - v_hat_t||_2`` from metadata alone."""

    def decode_rounding(self, head_dim: int | None = None) -> float:
        """``c`` such that any FP32 evaluation of :meth:`decode` (a fused kernel's included, FMA
        or not) is within ``c u (max_t ||v_t||_2 + 2^-24 sqrt(d))`` of this codec's own decode
        (the maximum over the block's tokens; per-token codecs meet it with the token's own
        norm; E_arith uses V_max), on which ``eta_b`` is measured, for values of ``head_dim``
        channels (None: any the codec accepts). 0 for exact decoders."""
        return 0.0
