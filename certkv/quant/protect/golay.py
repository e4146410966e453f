"""Extended binary Golay(24,12,8) over three 4-bit values (seed 003, Section 4.4).

``G = [I_12 | B]`` with the seed's printed ``B`` (symmetric, ``B B^T = I``), ``H = [B^T | I_12]``.
A codeword is ``[d | d B]``: the 12 data bits (three values, LSB-first: ``d = v_0 | v_1 << 4 |
v_2 << 8``) then 12 parity bits; bit ``i`` of the stored 24-bit word is codeword bit ``i``. The
syndrome of a received ``[d' | p']`` is ``d' B + p'`` (``B`` symmetric). The minimum distance 8
makes the syndromes of the 2,325 error patterns of weight <= 3 distinct, so a 4096-entry table
maps each of them to its pattern (corrected); the other 1,771 syndromes are those of weight-4
patterns (detected: an erasure). Heavier errors may be miscorrected or pass as clean.
"""

from __future__ import annotations

from itertools import combinations

import torch

from certkv.quant.protect.base import CLEAN, CORRECTED, DETECTED, Code
from certkv.registry import PROTECTION_CODES

B_ROWS = (
    "110111000101", "101110001011", "011100010111", "111000101101",
    "110001011011", "100010110111", "000101101111", "001011011101",
    "010110111001", "101101110001", "011011100011", "111111111110",
)


def b_matrix() -> torch.Tensor:
    """The seed's ``B`` (12 x 12, int64 0/1)."""
    return torch.tensor([[int(c) for c in row] for row in B_ROWS])


def _parity_masks() -> list[int]:
    """Bit mask over the 12 data bits of each parity bit ``j``: column ``j`` of ``B``."""
    b = b_matrix()
    return [sum(int(b[i, j]) << i for i in range(12)) for j in range(12)]


def _times_b(data: int, masks: list[int]) -> int:
    return sum((bin(data & m).count("1") & 1) << j for j, m in enumerate(masks))


def golay_tables() -> tuple[list[int], list[int], list[int]]:
    """``(encode[4096], error[4096], status[4096])``: codeword of each data word; error pattern
    and status of each syndrome."""
    masks = _parity_masks()
    times_b = [_times_b(d, masks) for d in range(4096)]
    encode = [d | times_b[d] << 12 for d in range(4096)]
    error = [0] * 4096
    status = [DETECTED] * 4096
    for weight in range(4):
        for positions in combinations(range(24), weight):
            e = sum(1 << p for p in positions)
            s = times_b[e & 4095] ^ (e >> 12)
            assert status[s] == DETECTED, "two patterns of weight <= 3 share a syndrome"
            error[s], status[s] = e, CORRECTED if weight else CLEAN
    return encode, error, status


@PROTECTION_CODES.register("golay24")
class Golay24(Code):
    """Extended Golay(24,12): 8 bits per value; corrects weight <= 3, detects weight 4."""

    by_syndrome = True

    name = "golay24"
    word_bits = 24
    values_per_word = 3

    def __init__(self) -> None:
        encode, error, status = golay_tables()
        self._enc = torch.tensor(encode)
        self._err = torch.tensor(error)
        self._status = torch.tensor(status, dtype=torch.uint8)
        self._times_b = torch.tensor([e >> 12 for e in encode])  # d B for every data word

    def encode(self, data: torch.Tensor) -> torch.Tensor:
        return self._enc.to(data.device)[data]

    def syndrome(self, words: torch.Tensor) -> torch.Tensor:
        """``d' B + p'`` of received 24-bit words (int64)."""
        return self._times_b.to(words.device)[words & 4095] ^ (words >> 12)

    def decode(self, words: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.syndrome(words)
        status = self._status.to(words.device)[s]
        fixed = torch.where(status == DETECTED, words, words ^ self._err.to(words.device)[s])
        return fixed & 4095, status
