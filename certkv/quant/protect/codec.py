"""Protected codecs: any codec whose codes are 4-bit aligned, with its codes stored as ECC words.

A protected codec wraps an inner key or value codec (seed 003, Section 4): the inner codec's
``codes`` (``[Hkv, n, B, d bits / 8]`` bytes, 2-, 4- or 8-bit codes packed LSB-first along the
channels: INT4 values, INT8 keys as two 4-bit halves, KIVI codes, ...) are split into 4-bit
nibbles (low half of each byte first), the block's nibbles are grouped into the code's words
(zero-padded to whole words) and stored as packed codewords (``ecc``). Metadata (scales, offsets)
stays as the inner codec stores it, unprotected, like the seed. With ``integrity`` on, the
block also stores :func:`~certkv.quant.protect.integrity.block_hash` of its inner codes and
metadata (``check``).

Reading a block (:meth:`ProtectedCodec.read`) decodes every word (syndrome, correct, flag):
corrected words are fixed, erased words (errors the code detects but cannot fix) are repaired
in the real domain (``erasure="zero"``: the element is 0; ``"interp"``: the midpoint of the
nearest valid tokens of its channel in the block, the one valid neighbour at an edge or next to
a run, 0 when the whole column is erased), and the integrity check says whether the codes and
metadata read are those written. A block that fails it is **corrupted**: the store serves it
from its FP16 originals (:class:`~certkv.cache.store.TieredKVStore`), so the certificate's
precondition (a codec's stated bound holds for what is read) is restored. Its only residual
risk is a corruption that passes both hashes, probability below ``2^-61`` per corrupted block.

Bounds: a protected codec states its inner codec's bounds, which hold for every block that
reads back intact (the integrity check) or that no fault touched.
"""

from __future__ import annotations

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import Blocks, KeyCodec, LayerContext, ValueCodec
from certkv.quant.protect.base import DETECTED, Code
from certkv.quant.protect.integrity import block_hash

ERASURES = ("zero", "interp")


class BlockRead:
    """What reading protected blocks found: ``corrected``, ``erased`` int64 ``[Hkv, n]`` words
    per block, ``intact`` bool ``[Hkv, n]`` (the integrity check passed; all True without it)."""

    def __init__(self, corrected: torch.Tensor, erased: torch.Tensor, intact: torch.Tensor):
        self.corrected, self.erased, self.intact = corrected, erased, intact


class ProtectedCodec:
    """The shared part of :class:`ProtectedKeyCodec` and :class:`ProtectedValueCodec`.

    Args:
        inner: the codec whose codes are protected.
        code: the error-correcting code (:class:`~certkv.quant.protect.base.Code`).
        erasure: ``"zero"`` or ``"interp"`` (module docstring).
        integrity: store and verify the per-block hash.
    """

    def __init__(self, inner, code: Code, erasure: str = "zero", integrity: bool = True):
        require(erasure in ERASURES, ConfigError,
                f"erasure={erasure!r} is unknown; use one of {list(ERASURES)}.")
        self.inner, self.code, self.erasure, self.integrity = inner, code, erasure, integrity
        self.bits = inner.bits
        self.name = f"{inner.name}+{code.name}"
        self._layout: tuple[tuple[int, ...], torch.dtype] | None = None  # codes [B, L], dtype
        self._written: tuple[Blocks, Blocks] | None = None  # the last write: (stored, inner)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.inner!r}, {self.code.name}, erasure={self.erasure}"
                f", integrity={self.integrity})")

    def __eq__(self, other) -> bool:
        return type(self) is type(other) and repr(self) == repr(other)

    __hash__ = None

    def validate(self, head_dim: int, block_size: int) -> None:
        self.inner.validate(head_dim, block_size)
        probe = self.inner.stored_layout(block_size, head_dim)
        codes = probe.get("codes")
        aligned = (self.inner.bits in (2, 4, 8) and codes is not None and codes.dim() == 4
                   and codes.element_size() == 1
                   and codes.shape[2:] == (block_size, head_dim * self.inner.bits // 8))
        require(aligned, ConfigError,
                f"protect.code={self.code.name} (integrity={self.integrity}) needs 4-bit aligned "
                f"codes (2, 4 or 8 bits packed along the channels) but the {self.inner.name} codec "
                f"at {self.inner.bits} bits stores others; use protect=none with integrity=false "
                "for it.")

    # ------------------------------------------------------------------ writing
    def _stored(self, blocks: Blocks) -> Blocks:
        codes = blocks["codes"]
        self._layout = (tuple(codes.shape[2:]), codes.dtype)
        raw = codes.contiguous().view(torch.uint8).flatten(2)  # [Hkv, n, B L]
        nibbles = torch.stack([raw & 15, raw >> 4], dim=-1).flatten(2)  # low half first
        pad = -nibbles.shape[-1] % self.code.values_per_word
        nibbles = torch.nn.functional.pad(nibbles, (0, pad))
        out = {name: t for name, t in blocks.items() if name != "codes"}
        out["ecc"] = self.code.protect(nibbles)
        if self.integrity:
            out["check"] = block_hash(blocks)
        self._written = (out, blocks)  # the store measures what it wrote before faults hit it
        return out

    # ------------------------------------------------------------------ reading
    def nibble_count(self) -> tuple[int, int]:
        """``(m, padded)``: 4-bit values of one block's codes, and padded to whole words."""
        (block, width), _ = self._layout
        m = block * width * 2
        return m, m + (-m % self.code.values_per_word)

    def assemble(self, blocks: Blocks, nibbles: torch.Tensor) -> Blocks:
        """The inner codec's blocks from stored ``blocks`` (metadata) and decoded 4-bit values
        ``nibbles [Hkv, n, >= m]`` (low half of each code byte first)."""
        (block, width), dtype = self._layout
        m, _ = self.nibble_count()
        nib = nibbles[..., :m].reshape(*nibbles.shape[:2], block * width, 2)
        raw = (nib[..., 0] | (nib[..., 1] << 4)).reshape(*nibbles.shape[:2], block, width)
        inner = {name: t for name, t in blocks.items() if name not in ("ecc", "check")}
        inner["codes"] = raw.view(dtype) if dtype != torch.uint8 else raw
        return inner

    def _recover(self, blocks: Blocks) -> tuple[Blocks, torch.Tensor, BlockRead]:
        """Inner blocks as read, the per-nibble erasure flags ``[Hkv, n, B, 2 L]`` and the
        block read."""
        if self._written is not None and blocks is self._written[0]:  # as written: clean
            inner = self._written[1]
            zeros = torch.zeros(inner["codes"].shape[:2], dtype=torch.int64,
                                device=inner["codes"].device)
            (block, width), _ = self._layout
            flags = torch.zeros(*zeros.shape, block, 2 * width, dtype=torch.bool,
                                device=zeros.device)
            return inner, flags, BlockRead(zeros, zeros, torch.ones_like(zeros, dtype=torch.bool))
        (block, width), _ = self._layout
        m, padded = self.nibble_count()
        k = self.code.values_per_word
        nibbles, status = self.code.recover(blocks["ecc"], padded)
        words = status.reshape(*status.shape[:-1], padded // k, k)[..., 0]
        corrected = ((words != 0) & (words != DETECTED)).sum(dim=-1)
        erased = (words == DETECTED).sum(dim=-1)
        inner = self.assemble(blocks, nibbles)
        if self.integrity:
            intact = (block_hash(inner) == blocks["check"]).all(dim=-1)
        else:
            intact = torch.ones_like(erased, dtype=torch.bool)
        flags = (status[..., :m] == DETECTED).reshape(*nibbles.shape[:2], block, width * 2)
        return inner, flags, BlockRead(corrected, erased, intact)

    def read(self, blocks: Blocks) -> BlockRead:
        """Decode the stored words of ``blocks`` and check them (nothing is repaired here)."""
        return self._recover(blocks)[2]

    def _element_flags(self, nibble_flags: torch.Tensor) -> torch.Tensor:
        """Per-nibble flags ``[..., 2 L]`` -> per-element ``[..., d]`` (an element is erased when
        a nibble holding any of its bits is)."""
        if self.bits == 8:
            return nibble_flags.reshape(*nibble_flags.shape[:-1], nibble_flags.shape[-1] // 2,
                                        2).any(dim=-1)
        return nibble_flags.repeat_interleave(4 // self.bits, dim=-1)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        """FP32 ``[Hkv, n, B, d]``: corrected codes decoded by the inner codec; erased elements
        repaired (``erasure``) unless the integrity check shows the block's codes as written
        (a double error in parity bits alone leaves the value right)."""
        inner, flags, found = self._recover(blocks)
        x = self.inner.decode(inner)
        verified = found.intact if self.integrity else torch.zeros_like(found.intact)
        erased = self._element_flags(flags) & ~verified[..., None, None]
        if not bool(erased.any()):
            return x
        return repair(x, erased, self.erasure)

    def inner_blocks(self, blocks: Blocks) -> Blocks:
        """The inner codec's blocks as read (corrected codes; for its bounds)."""
        return self._recover(blocks)[0]


def repair(x: torch.Tensor, erased: torch.Tensor, erasure: str) -> torch.Tensor:
    """``x [Hkv, n, B, d]`` with its ``erased`` elements set to 0 (``"zero"``) or to the
    midpoint of the nearest valid tokens of the same channel in the block (``"interp"``: the
    one valid neighbour at an edge, 0 when the channel has none)."""
    x = torch.where(erased, torch.zeros_like(x), x)
    if erasure == "zero":
        return x
    block = x.shape[-2]
    t = torch.arange(block, device=x.device).view(-1, 1).expand_as(x)
    before = torch.where(erased, torch.full_like(t, -1), t).cummax(dim=-2).values
    after = torch.where(erased, torch.full_like(t, block), t).flip(-2).cummin(dim=-2).values
    after = after.flip(-2)
    has_b, has_a = before >= 0, after < block
    vb = torch.gather(x, -2, before.clamp(min=0))
    va = torch.gather(x, -2, after.clamp(max=block - 1))
    mid = torch.where(has_b & has_a, (vb + va) / 2,
                      torch.where(has_b, vb, torch.where(has_a, va, torch.zeros_like(x))))
    return torch.where(erased, mid, x)


class WrappedKeyCodec(KeyCodec):
    """A key codec that stores its ``inner`` codec's blocks as ``_stored`` makes them (code
    words, a check); its checks and bounds are the inner codec's, on the inner blocks
    (``inner_blocks``) of what is read."""

    def encode(self, k: torch.Tensor) -> Blocks:
        return self._stored(self.inner.encode(k))

    def encode_at(self, k: torch.Tensor, start: torch.Tensor,
                  layer: LayerContext | None = None) -> Blocks:
        return self._stored(self.inner.encode_at(k, start, layer))

    def check_encodable(self, k: torch.Tensor, start: torch.Tensor) -> None:
        self.inner.check_encodable(k, start)

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        return self.inner.channel_bound(self.inner_blocks(blocks))

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        return self.inner.decode_slack(self.inner_blocks(blocks))


class WrappedValueCodec(ValueCodec):
    """A value codec that stores its ``inner`` codec's blocks as ``_stored`` makes them; its
    bounds are the inner codec's (see :class:`WrappedKeyCodec`)."""

    def encode(self, v: torch.Tensor) -> Blocks:
        return self._stored(self.inner.encode(v))

    def encode_at(self, v: torch.Tensor, layer: LayerContext | None = None) -> Blocks:
        return self._stored(self.inner.encode_at(v, layer))

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        return self.inner.token_bound(self.inner_blocks(blocks))

    def decode_rounding(self, head_dim: int | None = None) -> float:
        return self.inner.decode_rounding(head_dim)


class ProtectedKeyCodec(ProtectedCodec, WrappedKeyCodec):
    """A key codec whose codes are ECC-protected; bounds are the inner codec's."""


class ProtectedValueCodec(ProtectedCodec, WrappedValueCodec):
    """A value codec whose codes are ECC-protected; bounds are the inner codec's."""
