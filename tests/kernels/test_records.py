"""Records (:mod:`certkv.kernels.records`): each sequence's kernel arguments as one row of an
int64 table, read back by the kernels as the pointers, integers and floats they were."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from certkv.errors import ConfigError
from certkv.kernels.records import INT, REAL, integer, pointer, real, records


@triton.jit
def _read_back(seq_ptr, out_ptr, KINDS: tl.constexpr, W: tl.constexpr):
    """Per sequence: its FP16 and int8 tensors' first ``n`` entries, ``n``, and a float."""
    s = tl.program_id(0)
    rec = seq_ptr + s * len(KINDS)
    i = tl.arange(0, W)
    n = integer(rec, 1)
    x = tl.load(pointer(rec, 0, KINDS[0]) + i, mask=i < n, other=0).to(tl.float32)
    y = tl.load(pointer(rec, 2, KINDS[2]) + i, mask=i < n, other=0).to(tl.float32)
    tl.store(out_ptr + s * (W + 1) + i, x + y * real(rec, 3))
    tl.store(out_ptr + s * (W + 1) + W, n.to(tl.float32))


def test_each_sequence_reads_its_own_tensors_integers_and_floats_through_its_record():
    lengths, scales = (3, 7, 5), (0.5, 1.0 / 3.0, 2.0)
    xs = [torch.arange(n, dtype=torch.float16) + 100 * j for j, n in enumerate(lengths)]
    ys = [torch.arange(n, dtype=torch.int8) - 2 for n in lengths]
    rec = records([(x, n, y, f) for x, n, y, f in zip(xs, lengths, ys, scales, strict=True)],
                  torch.device("cpu"))
    assert rec.table.shape == (3, 4) and rec.kinds[1] == INT and rec.kinds[3] == REAL
    out = torch.zeros(3, 9)
    _read_back[(3,)](rec.table, out, KINDS=rec.kinds, W=8)
    for s, (x, y, f) in enumerate(zip(xs, ys, scales, strict=True)):
        n = x.numel()
        want = x.float() + y.float() * torch.tensor(f, dtype=torch.float32)  # FP32, as passed
        assert torch.equal(out[s, :n], want) and not out[s, n:8].any() and out[s, 8] == n


def test_a_table_is_made_once_per_content_so_a_steady_step_copies_nothing():
    x = torch.zeros(4)
    first = records([(x, 3)], torch.device("cpu"))
    assert records([(x, 3)], torch.device("cpu")).table is first.table
    assert records([(x, 4)], torch.device("cpu")).table is not first.table


def test_a_pointer_no_sequence_reads_takes_its_kind_from_the_others():
    x = torch.zeros(4, dtype=torch.int32)
    rec = records([(None, 1), (x, 2)], torch.device("cpu"))
    assert rec.table[0, 0] == 0 and rec.table[1, 0] == x.data_ptr()
    assert rec.kinds[0] == records([(x, 1)], torch.device("cpu")).kinds[0]


@pytest.mark.parametrize("other", [torch.zeros(4, dtype=torch.float16), 3, 0.5])
def test_sequences_giving_an_argument_of_different_kinds_are_refused_naming_the_fix(other):
    with pytest.raises(ConfigError, match="same config"):
        records([(torch.zeros(4),), (other,)], torch.device("cpu"))
