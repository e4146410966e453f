"""Hamming(7,4) and extended Hamming(8,4) SECDED over one 4-bit value (seed 003, Section 4.2).

Systematic, LSB-first as the seed prints them: data bits ``d_0..d_3`` are the value's bits
(value 2 -> ``d = [0, 1, 0, 0]``), the codeword is ``c = d G`` with ``G`` rows ``1000110``,
``0100101``, ``0010011``, ``0001111`` (bit ``i`` of the stored word is ``c_i``), and the
syndrome is ``H c^T`` with ``H`` rows ``1101100``, ``1011010``, ``0111001``. A nonzero syndrome
equals the column of ``H`` at the flipped position, so Hamming(7,4) corrects every single error
(and silently miscorrects heavier ones). Hamming(8,4) adds an overall parity bit ``c_7``:
syndrome != 0 with odd parity is a single error (corrected), syndrome != 0 with even parity a
double error (detected: an erasure), syndrome 0 with odd parity the parity bit itself (data
intact). Both decode by one 128- or 256-entry table lookup.
"""

from __future__ import annotations

import torch

from certkv.quant.protect.base import CLEAN, CORRECTED, DETECTED, Code
from certkv.registry import PROTECTION_CODES

G_ROWS = ("1000110", "0100101", "0010011", "0001111")
H_ROWS = ("1101100", "1011010", "0111001")


def _bits(row: str) -> list[int]:
    return [int(c) for c in row]


def hamming74_encode(value: int) -> int:
    """The 7-bit codeword of a 4-bit value (bit ``i`` = ``c_i``)."""
    word = 0
    for i, row in enumerate(G_ROWS):
        if value >> i & 1:
            word ^= sum(b << j for j, b in enumerate(_bits(row)))
    return word


def syndrome(word: int) -> int:
    """``H c^T`` of a 7-bit word, as an integer (bit ``r`` = row ``r``)."""
    return sum((sum(b & (word >> j) for j, b in enumerate(_bits(row))) & 1) << r
               for r, row in enumerate(H_ROWS))


def _column(j: int) -> int:
    return sum(int(row[j]) << r for r, row in enumerate(H_ROWS))


def _decode7(word: int) -> tuple[int, bool]:
    """Data and whether a (single) error was corrected."""
    s = syndrome(word)
    if s:
        word ^= 1 << next(j for j in range(7) if _column(j) == s)
    return word & 15, bool(s)


@PROTECTION_CODES.register("hamming74")
class Hamming74(Code):
    """Hamming(7,4): 7 bits per value, corrects one error per word, detects none."""

    name = "hamming74"
    word_bits = 7

    def __init__(self) -> None:
        self._enc = torch.tensor([hamming74_encode(v) for v in range(16)])
        table = [_decode7(w) for w in range(128)]
        self._data = torch.tensor([d for d, _ in table])
        self._status = torch.tensor([CORRECTED if c else CLEAN for _, c in table],
                                    dtype=torch.uint8)

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        return self._enc.to(data.device)[data]

    def decode(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data.to(words.device)[words], self._status.to(words.device)[words]


@PROTECTION_CODES.register("hamming84")
class Hamming84(Code):
    """Extended Hamming(8,4) SECDED: 8 bits per value; a double error is an erasure."""

    name = "hamming84"
    word_bits = 8

    def __init__(self) -> None:
        enc = []
        for v in range(16):
            w = hamming74_encode(v)
            enc.append(w | (bin(w).count("1") & 1) << 7)
        self._enc = torch.tensor(enc)
        data, status = [], []
        for w in range(256):
            s, odd = syndrome(w & 127), bin(w).count("1") & 1
            if s and odd:  # a single error among c_0..c_6
                d, _ = _decode7(w & 127)
                data.append(d)
                status.append(CORRECTED)
            elif s:  # two errors: seen, not fixable
                data.append(w & 15)
                status.append(DETECTED)
            else:  # clean, or only the parity bit flipped
                data.append(w & 15)
                status.append(CORRECTED if odd else CLEAN)
        self._data = torch.tensor(data)
        self._status = torch.tensor(status, dtype=torch.uint8)

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        return self._enc.to(data.device)[data]

    def decode(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._data.to(words.device)[words], self._status.to(words.device)[words]
