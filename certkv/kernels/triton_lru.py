"""The device page-in in one Triton launch (issue 55): the scratch cache's LRU bookkeeping and
the copies of its misses, keys and values, one program each.

:func:`certkv.cache.device_scratch.lru_step` states a step of the device-side LRU as about 70
fixed-shape PyTorch operators (a compiled segment before this kernel), and
a fill kernel copied the misses in a second launch. Here one
program per kind walks the wanted (kv head, block) cells in order, as ``lru_step`` does:

1. hits keep their slot and are stamped with the step's clock;
2. the slots not used this step, least recently used first (one sort of keys that pack the
   stamp above the slot index: ties in slot order, as the stable argsort), go to the misses in
   cell order; a taken slot's previous owner loses it; misses beyond the free slots are read
   by Phase 2 from Tier-2 in place (slot ``-2 - row``);
3. the slot map, the tallies (hits, misses, direct reads) and the count of wanted value blocks
   are written, then the taken slots are filled from Tier-2 (pinned host memory through
   unified addressing on CUDA), one block per miss: a steady step of scratch hits copies
   nothing.

Without a scratch cache every wanted block is read from Tier-2 in place. The host never learns
which blocks moved. ``tests/cache/test_device_scratch.py`` holds the kernel to ``lru_step``
and to the host LRU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from certkv.errors import ConfigError, require
from certkv.kernels.records import integer, pointer, records

_SLOT_BITS = 20  # slot index bits under a sort key's stamp bits
_USED = 1 << 41  # the sort key's stamp for slots used this step (and padding): last


@triton.jit
def _page_in_kind(want_ptr, maps_ptr, count_ptr, stamp_ptr, owner_ptr, slot_ptr, clock_ptr,
                  tally_ptr, order_ptr, victim_ptr, row_ptr, tier2_ptr, pool_ptr, hkv, n, width,
                  rows_width, cells_width, size, s_2p, s_2t, s_pp, s_pt,
                  LRU: tl.constexpr, CELLS: tl.constexpr, SLOTS: tl.constexpr,
                  B: tl.constexpr, D: tl.constexpr, SLOT_BITS: tl.constexpr,
                  USED: tl.constexpr):
    """One kind's page-in (see the module): ``want [Hkv, n]`` bool (row stride ``width``,
    as ``maps``) -> ``maps [Hkv, n]`` int32 and ``count`` (0-d int64, the wanted blocks);
    with ``LRU`` the tables
    (:class:`~certkv.cache.device_scratch.LRUTables`) updated in place and the pool filled."""
    total = hkv * n
    wanted_n = 0
    if LRU:
        clock = tl.load(clock_ptr) + 1
        tl.store(clock_ptr, clock)
        hits = 0
        for start in range(0, total, CELLS):  # hits keep their slot, stamped
            i = start + tl.arange(0, CELLS)
            live = i < total
            cell = (i // n) * cells_width + i % n
            at = (i // n) * width + i % n
            wanted = live & (tl.load(want_ptr + at, mask=live, other=0) != 0)
            current = tl.load(slot_ptr + cell, mask=live, other=-1)
            hit = wanted & (current >= 0)
            tl.store(stamp_ptr + current, clock + tl.zeros((CELLS,), tl.int64), mask=hit)
            hits += tl.sum(hit.to(tl.int32), axis=0)
        tl.debug_barrier()
        s = tl.arange(0, SLOTS)  # the free slots, least recently used first
        in_pool = s < size
        stamps = tl.load(stamp_ptr + s, mask=in_pool, other=0)
        used = ~in_pool | (stamps == clock)
        free = tl.sum((~used).to(tl.int32), axis=0)
        keys = tl.where(used, USED, stamps + 1) * (1 << SLOT_BITS) + s
        order = (tl.sort(keys) & ((1 << SLOT_BITS) - 1)).to(tl.int32)
        tl.store(order_ptr + s, order, mask=in_pool)
        tl.debug_barrier()
        taken = 0
        direct = 0
        dummy_cell = hkv * cells_width
        for start in range(0, total, CELLS):  # misses take them in cell order
            i = start + tl.arange(0, CELLS)
            live = i < total
            cell = (i // n) * cells_width + i % n
            at = (i // n) * width + i % n
            row = (i // n) * rows_width + i % n
            wanted = live & (tl.load(want_ptr + at, mask=live, other=0) != 0)
            current = tl.load(slot_ptr + cell, mask=live, other=-1)
            hit = wanted & (current >= 0)
            miss = wanted & (current < 0)
            rank = taken + tl.cumsum(miss.to(tl.int32), axis=0) - 1
            take = miss & (rank < free)
            victim = tl.load(order_ptr + rank, mask=take, other=0)
            before = tl.load(owner_ptr + victim, mask=take, other=dummy_cell)
            tl.store(slot_ptr + before, tl.full((CELLS,), -1, tl.int32), mask=take)
            tl.store(slot_ptr + cell, victim, mask=take)
            tl.store(owner_ptr + victim, cell.to(tl.int64), mask=take)
            tl.store(stamp_ptr + victim, clock + tl.zeros((CELLS,), tl.int64), mask=take)
            tl.store(victim_ptr + rank, victim, mask=take)
            tl.store(row_ptr + rank, row, mask=take)
            after = tl.where(hit, current, tl.where(take, victim, -1))
            slot = tl.where(wanted, tl.where(after >= 0, after, -2 - row), -1)
            tl.store(maps_ptr + at, slot, mask=live)
            taken += tl.sum(take.to(tl.int32), axis=0)
            direct += tl.sum((wanted & (after < 0)).to(tl.int32), axis=0)
            wanted_n += tl.sum(wanted.to(tl.int32), axis=0)
        tl.store(tally_ptr, tl.load(tally_ptr) + hits)
        tl.store(tally_ptr + 1, tl.load(tally_ptr + 1) + taken)
        tl.store(tally_ptr + 2, tl.load(tally_ptr + 2) + direct)
        tl.debug_barrier()
        t = tl.arange(0, B)
        c = tl.arange(0, D)
        for r in range(taken):  # the misses' blocks from Tier-2 into their slots
            victim = tl.load(victim_ptr + r).to(tl.int64)
            src = tl.load(row_ptr + r).to(tl.int64)
            block = tl.load(tier2_ptr + src * s_2p + t[:, None] * s_2t + c[None, :])
            tl.store(pool_ptr + victim * s_pp + t[:, None] * s_pt + c[None, :], block)
    else:  # no scratch cache: every wanted block from Tier-2 in place
        for start in range(0, total, CELLS):
            i = start + tl.arange(0, CELLS)
            live = i < total
            row = (i // n) * rows_width + i % n
            at = (i // n) * width + i % n
            wanted = live & (tl.load(want_ptr + at, mask=live, other=0) != 0)
            tl.store(maps_ptr + at, tl.where(wanted, -2 - row, -1), mask=live)
            wanted_n += tl.sum(wanted.to(tl.int32), axis=0)
    tl.store(count_ptr, wanted_n.to(tl.int64))


@triton.jit
def _kind_fields(rec, K: tl.constexpr, KINDS: tl.constexpr):
    """One kind's fields of a sequence's record (from field ``K``, :func:`_kind`): the LRU's
    stamps, owners, slot table, clock and tally, Tier-2's rows, the pool, the slot table's
    width and the pool's size."""
    return (pointer(rec, K, KINDS[K]), pointer(rec, K + 1, KINDS[K + 1]),
            pointer(rec, K + 2, KINDS[K + 2]), pointer(rec, K + 3, KINDS[K + 3]),
            pointer(rec, K + 4, KINDS[K + 4]), pointer(rec, K + 5, KINDS[K + 5]),
            pointer(rec, K + 6, KINDS[K + 6]), integer(rec, K + 7), integer(rec, K + 8))


@triton.jit
def _page_in_kernel(plan_ptr, maps_ptr, count_ptr, work_ptr, seq_ptr, hkv, width, work,
                    KINDS: tl.constexpr, LRU_A: tl.constexpr, LRU_B: tl.constexpr,
                    CELLS: tl.constexpr, SLOTS_A: tl.constexpr, SLOTS_B: tl.constexpr,
                    B: tl.constexpr, D: tl.constexpr, SLOT_BITS: tl.constexpr,
                    USED: tl.constexpr):
    """Grid ``(kind, sequence)``: kind 0 keys (``*_A``), 1 values (``*_B``). The plan and the
    maps ``[2, S, Hkv, W]``, the counts ``[2, S]`` and the work space ``[2, S, 3, work]``
    (int32) are the step's; sequence ``s``'s record holds its block count, Tier-2's row width
    and strides, the pools' strides, then each kind's tables (:func:`_kind_fields`)."""
    kind = tl.program_id(0)
    seq = tl.program_id(1)
    nseq = tl.num_programs(1)
    rec = seq_ptr + seq * len(KINDS)
    at = (kind * nseq + seq) * hkv * width
    scratch = work_ptr + (kind * nseq + seq) * 3 * work
    n = integer(rec, 0)
    rows_width = integer(rec, 1)
    s_2p = integer(rec, 2)
    s_2t = integer(rec, 3)
    s_pp = integer(rec, 4)
    s_pt = integer(rec, 5)
    if kind == 0:
        stamp, owner, slot_of, clock, tally, tier2, pool, cells, size = _kind_fields(
            rec, 6, KINDS)
        _page_in_kind(plan_ptr + at, maps_ptr + at, count_ptr + seq, stamp, owner, slot_of,
                      clock, tally, scratch, scratch + work, scratch + 2 * work, tier2, pool,
                      hkv, n, width, rows_width, cells, size, s_2p, s_2t, s_pp, s_pt, LRU_A,
                      CELLS, SLOTS_A, B, D, SLOT_BITS, USED)
    else:
        stamp, owner, slot_of, clock, tally, tier2, pool, cells, size = _kind_fields(
            rec, 15, KINDS)
        _page_in_kind(plan_ptr + at, maps_ptr + at, count_ptr + nseq + seq, stamp, owner,
                      slot_of, clock, tally, scratch, scratch + work, scratch + 2 * work,
                      tier2, pool, hkv, n, width, rows_width, cells, size, s_2p, s_2t, s_pp,
                      s_pt, LRU_B, CELLS, SLOTS_B, B, D, SLOT_BITS, USED)


def page_in(plan: torch.Tensor, rows_width: int, tables: list, pools: list,
            tier2: tuple[torch.Tensor, torch.Tensor]):
    """A step's page-in of keys and values in one launch.

    Args:
        plan: bool ``[2, Hkv, n]`` (FP16 keys, FP16 values wanted); rows_width: Tier-2 rows per
            kv head (block ``b`` of kv head ``h`` is row ``h * rows_width + b``).
        tables: per kind the LRU's :class:`~certkv.cache.device_scratch.LRUTables` (over at
            least ``n`` blocks; updated in place) or None (no scratch cache).
        pools: per kind the FP16 slots ``[S, B, d]`` (filled in place; any FP16 block where
            ``tables`` is None, never read); tier2: the FP16 originals ``(k, v)`` as ``[R, B,
            d]`` row views (read in place).
    Returns ``(maps [2, Hkv, n] int32, wanted [2] int64)``: the slot maps (-1 where not wanted,
    ``-2 - row`` for Tier-2 in place) and how many blocks of each kind were wanted.
    """
    n = plan.shape[2]
    maps, wanted = page_in_batch(plan.contiguous()[:, None], [(n, rows_width, tables, pools,
                                                                tier2)])
    return maps[:, 0], wanted[:, 0]


def page_in_batch(plan: torch.Tensor, sequences: list[tuple]):
    """:func:`page_in` over a batch in one launch: ``plan [2, S, Hkv, W]`` (contiguous),
    ``sequences[s]``: sequence ``s``'s ``(n, rows_width, tables, pools, tier2)`` as
    :func:`page_in` takes them. Returns ``(maps [2, S, Hkv, W], wanted [2, S])``."""
    _, nseq, hkv, width = plan.shape
    dev = plan.device
    assert plan.is_contiguous()
    maps = torch.empty(2, nseq, hkv, width, dtype=torch.int32, device=dev)
    wanted = torch.empty(2, nseq, dtype=torch.int64, device=dev)
    lru = [[seq[2][i] is not None for seq in sequences] for i in range(2)]
    require(all(len(set(x)) == 1 for x in lru), ConfigError,
            "some sequences of a batch have a scratch cache and some have none; give every "
            "sequence one or none.")
    rows, slots, work = [], [1, 1], 1
    for n, rows_width, tables, pools, tier2 in sequences:
        k2 = tier2[0]
        assert all(t.stride() == k2.stride() and t.stride(-1) == 1 for t in tier2)
        assert all(p.stride(-1) == 1 and p.stride()[1:] == pools[0].stride()[1:] for p in pools)
        row = [n, rows_width, k2.stride(0), k2.stride(1), pools[0].stride(0), pools[0].stride(1)]
        for i in range(2):
            fields, size = _kind(tables[i], pools[i], tier2[i], hkv)
            row += fields
            slots[i] = max(slots[i], triton.next_power_of_2(max(size, 1)))
            work = max(work, size)
        rows.append(tuple(row))
    rec = records(rows, dev)
    scratch = torch.empty(2, nseq, 3, work, dtype=torch.int32, device=dev)
    k2 = sequences[0][4][0]
    _page_in_kernel[(2, nseq)](
        plan, maps, wanted, scratch, rec.table, hkv, width, work, KINDS=rec.kinds,
        LRU_A=lru[0][0], LRU_B=lru[1][0],
        CELLS=min(1024, triton.next_power_of_2(max(hkv * width, 1))), SLOTS_A=slots[0],
        SLOTS_B=slots[1], B=k2.shape[1], D=k2.shape[2], SLOT_BITS=_SLOT_BITS, USED=_USED)
    return maps, wanted


def _kind(tables, pool, tier2, hkv):
    """One kind's record fields (:func:`_kind_fields`) and its pool's size."""
    if tables is None:  # pointers the kernel never reads
        return [None, None, None, None, None, tier2, pool, 0, 0], 0
    stamp, owner, slot_of, clock, tally = tables
    size = stamp.shape[0] - 1  # the last entry is the dummy
    return [stamp, owner, slot_of, clock, tally, tier2, pool, (slot_of.shape[0] - 1) // hkv,
            size], size
