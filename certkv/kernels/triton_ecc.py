"""Triton decode of ECC-protected codes (seed 003): stored code words -> corrected 4-bit values.

The Triton path of a protected precision (:mod:`certkv.quant.protect.codec`): before a phase
reads a protected precision's codes, this kernel decodes its words (syndrome, correct) into the
inner codec's plain codes, which the phase kernels then read as usual (one extra launch per
protected precision and phase; the words stay the only copy in Tier-1). Words are packed densely,
``W`` bits each, little-endian (:func:`~certkv.quant.protect.base.pack_words`): word ``w`` of a
row starts at bit ``w W``, so the kernel loads the four bytes from ``floor(w W / 8)`` and shifts.

* Hamming(7,4) / (8,4): the corrected data is one lookup of the whole word (128 / 256 entries);
* Golay(24,12): the syndrome is ``(d' B) xor p'`` (a 4096-entry table of ``d B``), the error
  pattern a lookup of the syndrome, applied unless the syndrome is a weight-4 one (detected).

Erasure flags are not produced here: the Triton path reads protected precisions only where no
erasure needs repairing (the integrity check on, or no erased word in the store); the PyTorch
reference does the rest (:func:`certkv.kernels.triton_sources.block_sources`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.quant.protect.base import DETECTED, Code

_WORDS = 1024  # words per program


@triton.jit
def _ecc_decode_kernel(words_ptr, out_ptr, data_ptr, times_b_ptr, err_ptr, status_ptr,
                       row_bytes, n_words, out_row, detected,
                       WORD_BITS: tl.constexpr, PER_WORD: tl.constexpr, GOLAY: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    w = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # a long row's bits pass 2^31
    live = w < n_words
    bit = w * WORD_BITS
    first = bit // 8
    base = words_ptr + row * row_bytes
    word = tl.zeros([BLOCK], dtype=tl.int64)
    for i in tl.static_range(4):
        byte = tl.load(base + first + i, mask=live & (first + i < row_bytes), other=0)
        word = word | (byte.to(tl.int64) << (8 * i))
    word = (word >> (bit % 8).to(tl.int64)) & ((1 << WORD_BITS) - 1)
    if GOLAY:
        syndrome = tl.load(times_b_ptr + (word & 4095), mask=live, other=0) ^ (word >> 12)
        error = tl.load(err_ptr + syndrome, mask=live, other=0)
        flag = tl.load(status_ptr + syndrome, mask=live, other=0)
        data = tl.where(flag == detected, word, word ^ error) & 4095
    else:
        data = tl.load(data_ptr + word, mask=live, other=0)
    for j in tl.static_range(PER_WORD):
        tl.store(out_ptr + row * out_row + w * PER_WORD + j, ((data >> (4 * j)) & 15).to(tl.uint8),
                 mask=live)


def _tables(code: Code, device: torch.device) -> tuple[torch.Tensor, ...]:
    """``(data, times_b, error, status)`` lookup tables of ``code`` on ``device`` (the unused
    ones are a valid dummy pointer)."""
    if code.by_syndrome:
        return (code._times_b.to(device), code._times_b.to(device), code._err.to(device),
                code._status.to(device, torch.int64))
    data = code._data.to(device)
    return data, data, data, data


def decode_words(code: Code, packed: torch.Tensor, m: int) -> torch.Tensor:
    """Corrected 4-bit values ``[..., m]`` (uint8) of the packed words ``packed [..., bytes]``
    of ``m`` values (``m`` a multiple of the code's values per word): what
    :meth:`Code.recover` returns, decoded by the Triton kernel. Where the rows hold no padding
    bits (every code but Hamming(7,4), whose 7-bit words may leave some at a row's end), the
    rows are one long row: ``cdiv(rows m / values per word, 1024)`` programs, not one or more
    per row (a block's row is a token's few dozen words)."""
    rows = packed.reshape(-1, packed.shape[-1]).contiguous()
    n_words = m // code.values_per_word
    out = torch.empty(rows.shape[0], m, dtype=torch.uint8, device=packed.device)
    if rows.numel() and n_words:
        data, times_b, error, status = _tables(code, packed.device)
        flat = rows.shape[1] * 8 == n_words * code.word_bits  # no padding bits between rows
        if flat:  # one row of every word: row r's word w is word r * n_words + w
            rows, n_words, m = rows.view(1, -1), rows.shape[0] * n_words, rows.shape[0] * m
        grid = (rows.shape[0], triton.cdiv(n_words, _WORDS))
        _ecc_decode_kernel[grid](rows, out, data, times_b, error, status, rows.shape[1],
                                 n_words, m, DETECTED, WORD_BITS=code.word_bits,
                                 PER_WORD=code.values_per_word,
                                 GOLAY=code.by_syndrome, BLOCK=_WORDS)
    return out.reshape(*packed.shape[:-1], -1)
