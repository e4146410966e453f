"""Error-correcting codes over 4-bit code values (seed 003): the interface and the bit packing.

A :class:`Code` maps ``k`` 4-bit values (``k = 1`` for Hamming, 3 for Golay) to one ``n``-bit
codeword, stored densely (``n`` bits per word, packed little-endian into bytes, so Tier-1 counts
exactly ``n / k`` bits per value). Encoding and decoding are table lookups, vectorized over any
leading shape; decoding returns the corrected values and a status per word: :data:`CLEAN`,
:data:`CORRECTED` (an error the code fixed; the value may still be wrong if the error exceeded
the code's radius and it miscorrected) or :data:`DETECTED` (an error it could see but not fix:
an erasure).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

CLEAN, CORRECTED, DETECTED = 0, 1, 2


def _spans(m: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """First byte ``[m]`` and bit shift ``[m]`` of each of ``m`` words ``width`` bits wide in a
    little-endian stream, and how many bytes a word can touch."""
    bit = torch.arange(m, dtype=torch.int64, device=device) * width
    return bit // 8, bit % 8, (width + 14) // 8


def pack_words(words: torch.Tensor, width: int) -> torch.Tensor:
    """Integer words ``[..., m]`` (values below ``2^width``) -> bytes ``[..., ceil(m width / 8)]``:
    bit ``b`` of word ``i`` is bit ``i width + b`` of the little-endian stream."""
    words = words.to(torch.int64)
    m = words.shape[-1]
    size = -(-m * width // 8)
    if width % 8 == 0:  # byte-aligned words: their bytes in order
        shifts = 8 * torch.arange(width // 8, dtype=torch.int64, device=words.device)
        return ((words.unsqueeze(-1) >> shifts) & 255).flatten(-2).to(torch.uint8)
    first, shift, span = _spans(m, width, words.device)
    moved = words << shift  # [..., m], at most width + 7 bits
    out = torch.zeros(*words.shape[:-1], size + span, dtype=torch.int64, device=words.device)
    for j in range(span):  # the bits of different words never overlap: adding is or-ing
        out.index_add_(-1, first + j, (moved >> (8 * j)) & 255)
    return out[..., :size].to(torch.uint8)


def unpack_words(packed: torch.Tensor, width: int, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_words`: bytes -> int64 words ``[..., m]``."""
    raw = packed.to(torch.int64)
    if width % 8 == 0:
        nb = width // 8
        grouped = raw[..., : m * nb].reshape(*raw.shape[:-1], m, nb)
        shifts = 8 * torch.arange(nb, dtype=torch.int64, device=packed.device)
        return (grouped << shifts).sum(dim=-1)
    first, shift, span = _spans(m, width, packed.device)
    raw = torch.nn.functional.pad(raw, (0, span))
    word = torch.zeros(*raw.shape[:-1], m, dtype=torch.int64, device=packed.device)
    for j in range(span):
        word |= raw[..., first + j] << (8 * j)
    return (word >> shift) & ((1 << width) - 1)


def popcount_parity(x: torch.Tensor) -> torch.Tensor:
    """Parity (0/1) of the set bits of non-negative int64 ``x`` (below ``2^32``)."""
    x = x ^ (x >> 16)
    x = x ^ (x >> 8)
    x = x ^ (x >> 4)
    x = x ^ (x >> 2)
    x = x ^ (x >> 1)
    return x & 1


class Code(ABC):
    """A binary code over groups of ``values_per_word`` 4-bit values."""

    name: str = "code"
    word_bits: int = 4  # n
    values_per_word: int = 1  # k / 4
    by_syndrome = False  # decoded through syndrome tables (Golay), else a word table (Hamming)

    @property
    def bits_per_value(self) -> float:
        return self.word_bits / self.values_per_word

    @abstractmethod
    def encode(self, data: torch.Tensor) -> torch.Tensor:
        """Data words ``[...]`` (int64, ``4 values_per_word`` bits) -> codewords ``[...]``."""

    @abstractmethod
    def decode(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Received words ``[...]`` -> ``(data [...], status [...])`` (int64, status uint8)."""

    def protect(self, values: torch.Tensor) -> torch.Tensor:
        """4-bit values ``[..., m]`` (``m`` a multiple of ``values_per_word``) -> packed bytes."""
        data = self._group(values.to(torch.int64))
        return pack_words(self.encode(data), self.word_bits)

    def recover(self, packed: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Packed bytes of ``m`` values -> ``(values [..., m] uint8, status [..., m] uint8)``
        (each value gets its word's status)."""
        words = unpack_words(packed, self.word_bits, m // self.values_per_word)
        data, status = self.decode(words)
        k = self.values_per_word
        shifts = 4 * torch.arange(k, dtype=torch.int64, device=data.device)
        values = ((data.unsqueeze(-1) >> shifts) & 15).flatten(-2)
        return values.to(torch.uint8), status.repeat_interleave(k, dim=-1)

    def _group(self, values: torch.Tensor) -> torch.Tensor:
        k = self.values_per_word
        grouped = values.reshape(*values.shape[:-1], values.shape[-1] // k, k)
        shifts = 4 * torch.arange(k, dtype=torch.int64, device=values.device)
        return (grouped << shifts).sum(dim=-1)
