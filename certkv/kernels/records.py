"""Per-sequence kernel arguments as records: one launch over a batch's sequences (issue 54).

Each sequence of a batch owns its stores: buffers at their own addresses, with their own
strides, block counts and index lists. A kernel launched once over (sequence, ...) reads what
belongs to its sequence from a *record*: row ``s`` of an int64 table ``[S, F]`` in device
memory, one field per argument, in the kernel's order:

* a tensor's address (its element type, and whether the address is 16-byte aligned, are the
  field's *kind*: a compile-time constant, the same for every sequence);
* an integer (a stride, a count);
* a float's FP64 bits (read back as the FP32 a Python float argument is: the same rounding).

The kernel's first lines unpack its sequence's row (:func:`pointer`, :func:`integer`,
:func:`real`) into the names its body reads, so a body is the same for one sequence or many
(one sequence is a batch of one). Records hold only what the stores own, which stays where it
is while their layouts do; a table is kept by its content (:func:`records`), so a steady step
copies nothing to the device and a step replayed in a CUDA graph reads the same table. What a
step makes (the queries, each stage's results) is not in records: it is allocated for the whole
batch (``[S, ...]``) and offset by a sequence stride.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from certkv.errors import ConfigError, require

INT, REAL = 0, 1  # the kinds of integer and float fields
# pointer kinds: 2 * code + aligned, code from the element type
_POINTER_CODES = {torch.float16: 1, torch.float32: 2, torch.int8: 3, torch.uint8: 4,
                  torch.int16: 5, torch.int32: 6, torch.int64: 7, torch.bool: 8,
                  torch.float64: 9, torch.bfloat16: 10}
_KEPT = 1024  # tables kept (a batch's six launches per layer, for many layers and batches)


class Records(NamedTuple):
    """A launch's records: ``table`` int64 ``[S, F]`` on the device and each field's kind (a
    tuple of ``F`` ints, passed to the kernel as a compile-time constant)."""

    table: torch.Tensor
    kinds: tuple[int, ...]


_TABLES: OrderedDict = OrderedDict()  # (device, values, kinds) -> table


def records(rows: Sequence[Sequence], device: torch.device) -> Records:
    """The records of ``rows`` (one per sequence, its fields in the kernel's order: tensors,
    ints, bools, floats, or None for a pointer never read, whose kind another row gives).

    Every row must give a field the same kind (a tensor of one dtype, an int, a float): a
    batch is one config. The table is made once per content and kept (at most ``_KEPT``): a
    step reads its fields (one pass, no more) and finds its table."""
    width = len(rows[0])
    require(all(len(row) == width for row in rows), ConfigError,
            "the sequences of a batch give their kernels different arguments; build every "
            "store of a batch from the same config.")
    encoded = [tuple(map(_encode, row)) for row in rows]
    key = (str(device), tuple(encoded))
    kept = _TABLES.get(key)
    if kept is None:
        kinds = tuple(_kind(i, [row[i] for row in encoded]) for i in range(width))
        table = torch.tensor([[v for v, _ in row] for row in encoded],
                             dtype=torch.int64).to(device)
        kept = Records(table, kinds)
        _TABLES[key] = kept
        if len(_TABLES) > _KEPT:
            _TABLES.popitem(last=False)
    else:
        _TABLES.move_to_end(key)
    return kept


def _encode(x) -> tuple[int, object]:
    """A field as ``(the int64 the table holds, its sort)``: a tensor's address and dtype, an
    int and :data:`INT`, a float's FP64 bits and :data:`REAL`, None as ``(0, None)``."""
    if isinstance(x, torch.Tensor):
        return x.data_ptr(), x.dtype
    if isinstance(x, float):
        return _bits(x), REAL
    if x is None:
        return 0, None
    if isinstance(x, bool | int):
        return int(x), INT
    raise TypeError(f"a record field must be a tensor, an int or a float, not {type(x)}")


@lru_cache(maxsize=4096)
def _bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _kind(index: int, column: list[tuple[int, object]]) -> int:
    """The kind of field ``index`` from every row's encoded value (see :func:`records`)."""
    sorts = {sort for _, sort in column if sort is not None}
    require(len(sorts) <= 1, ConfigError,
            f"the sequences of a batch give a kernel argument ({index}) of different kinds "
            f"({sorted(map(str, sorts))}); build every store of a batch from the same config.")
    sort = sorts.pop() if sorts else torch.int8  # no row reads it: any pointer
    if sort in (INT, REAL):
        return sort
    aligned = all(value % 16 == 0 for value, s in column if s is not None)
    return 2 * _POINTER_CODES[sort] + int(aligned)


@triton.jit
def integer(rec, i):
    """Field ``i`` of the record at ``rec`` as an int64."""
    return tl.load(rec + i)


@triton.jit
def real(rec, i):
    """Field ``i`` of the record at ``rec``, a float's FP64 bits, as FP32."""
    return tl.load(rec + i).to(tl.float64, bitcast=True).to(tl.float32)


@triton.jit
def pointer(rec, i, KIND: tl.constexpr):
    """Field ``i`` of the record at ``rec``, an address, as a pointer of the kind's element
    type (16-byte aligned where the kind says so)."""
    addr = tl.load(rec + i)
    CODE: tl.constexpr = KIND // 2
    if CODE == 1:
        p = addr.to(tl.pointer_type(tl.float16))
    elif CODE == 2:
        p = addr.to(tl.pointer_type(tl.float32))
    elif CODE == 3:
        p = addr.to(tl.pointer_type(tl.int8))
    elif CODE == 4:
        p = addr.to(tl.pointer_type(tl.uint8))
    elif CODE == 5:
        p = addr.to(tl.pointer_type(tl.int16))
    elif CODE == 6:
        p = addr.to(tl.pointer_type(tl.int32))
    elif CODE == 7:
        p = addr.to(tl.pointer_type(tl.int64))
    elif CODE == 8:
        p = addr.to(tl.pointer_type(tl.int1))
    elif CODE == 9:
        p = addr.to(tl.pointer_type(tl.float64))
    else:
        p = addr.to(tl.pointer_type(tl.bfloat16))
    if KIND % 2 == 1:
        p = tl.multiple_of(p, 16)
    return p
