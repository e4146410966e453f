"""Seed 003's codes, exhaustively: Hamming(7,4), Hamming(8,4) SECDED, extended Golay(24,12)."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch

from certkv.quant.protect import CLEAN, CORRECTED, DETECTED, Golay24, Hamming74, Hamming84
from certkv.quant.protect.base import pack_words, unpack_words
from certkv.quant.protect.golay import b_matrix
from certkv.quant.protect.hamming import H_ROWS

VALUES = torch.arange(16)


def flips(width: int, weight: int) -> torch.Tensor:
    """Every error pattern of ``weight`` bits over ``width`` bits (int64)."""
    return torch.tensor([sum(1 << p for p in pos) for pos in combinations(range(width), weight)],
                        dtype=torch.int64)


def test_hamming74_matches_the_seed_and_corrects_every_single_error():
    code = Hamming74()
    assert code.encode(torch.tensor(2)).item() == 0b1010010  # c = [0,1,0,0,1,0,1], LSB first
    words = code.encode(VALUES)
    h = torch.tensor([[int(c) for c in row] for row in H_ROWS])
    bits = (words.unsqueeze(-1) >> torch.arange(7)) & 1
    assert ((bits @ h.T) % 2 == 0).all()  # G H^T = 0
    data, status = code.decode(words)
    assert torch.equal(data, VALUES) and (status == CLEAN).all()
    received = words.unsqueeze(-1) ^ flips(7, 1)  # [16, 7]
    data, status = code.decode(received)
    assert torch.equal(data, VALUES.unsqueeze(-1).expand(16, 7)) and (status == CORRECTED).all()


def test_hamming84_corrects_singles_and_flags_every_double():
    code = Hamming84()
    words = code.encode(VALUES)
    single = words.unsqueeze(-1) ^ flips(8, 1)
    data, status = code.decode(single)
    assert torch.equal(data, VALUES.unsqueeze(-1).expand(16, 8)) and (status == CORRECTED).all()
    double = words.unsqueeze(-1) ^ flips(8, 2)  # all 28 patterns
    assert (code.decode(double)[1] == DETECTED).all()
    assert (code.decode(words)[1] == CLEAN).all()


def test_golay_b_is_symmetric_orthogonal_and_the_code_has_distance_8():
    b = b_matrix()
    assert torch.equal(b, b.T)
    assert torch.equal(b @ b.T % 2, torch.eye(12, dtype=torch.long))
    code = Golay24()
    words = code.encode(torch.arange(4096))
    weights = ((words.unsqueeze(-1) >> torch.arange(24)) & 1).sum(dim=-1)
    assert weights[1:].min() == 8  # linear code: minimum distance = minimum nonzero weight
    assert (code.syndrome(words) == 0).all()


def test_golay_corrects_every_error_up_to_weight_3_and_detects_weight_4():
    code = Golay24()
    data = torch.tensor([0, 1, 0xABC, 4095])
    words = code.encode(data)
    patterns = torch.cat([flips(24, w) for w in range(4)])
    assert patterns.numel() == 2325
    fixed, status = code.decode(words.unsqueeze(-1) ^ patterns)
    assert torch.equal(fixed, data.unsqueeze(-1).expand_as(fixed))
    assert (status[:, 0] == CLEAN).all() and (status[:, 1:] == CORRECTED).all()
    four = flips(24, 4)
    assert (code.decode(words.unsqueeze(-1) ^ four)[1] == DETECTED).all()


@pytest.mark.parametrize("code", [Hamming74(), Hamming84(), Golay24()], ids=lambda c: c.name)
def test_values_round_trip_through_packed_storage(code):
    values = torch.randint(0, 16, (3, 2, 48), generator=torch.Generator().manual_seed(0))
    packed = code.protect(values)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == -(-48 * code.word_bits // code.values_per_word // 8)
    back, status = code.recover(packed, 48)
    assert torch.equal(back, values.to(torch.uint8)) and (status == CLEAN).all()
    assert code.bits_per_value == {"hamming74": 7, "hamming84": 8, "golay24": 8}[code.name]


def test_word_packing_is_dense_and_little_endian():
    words = torch.tensor([0b1010010, 0b0000001])
    packed = pack_words(words, 7)
    assert packed.tolist() == [0b1101_0010, 0b0000_0000]  # word 1's bit 0 is stream bit 7
    assert torch.equal(unpack_words(packed, 7, 2), words)


def test_injector_rate_matches_p_and_is_seeded():
    from scipy.stats import binomtest

    from certkv.quant.protect.faults import inject

    data = torch.zeros(400, 64, dtype=torch.uint8)
    for p in (1e-3, 1e-2, 0.3):
        flipped, count = inject(data, p, torch.Generator().manual_seed(1))
        bits = ((flipped.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).sum()
        assert int(bits) == count
        assert binomtest(count, data.numel() * 8, p).pvalue > 1e-3
    again, _ = inject(data, 1e-2, torch.Generator().manual_seed(1))
    assert torch.equal(again, inject(data, 1e-2, torch.Generator().manual_seed(1))[0])
    assert torch.equal(inject(data, 0.0, torch.Generator())[0], data)
    words = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    assert inject(words, 0.5, torch.Generator().manual_seed(2))[0].dtype == torch.int32


def test_a_rate_outside_zero_one_is_one_sentence():
    from certkv.errors import ConfigError
    from certkv.quant.protect.faults import check_rate

    with pytest.raises(ConfigError, match=r"p=1.5 must be a probability in \[0, 1\]"):
        check_rate(1.5)
