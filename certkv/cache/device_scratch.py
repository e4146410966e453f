"""The FP16 scratch cache with its bookkeeping in device memory (issue 24).

The same cache as :class:`~certkv.cache.scratch.ScratchCache`'s host LRU (paper 3.1; separate
key / value capacities, least recently used slot first, never a slot used this step), but the
slot table, owners and use stamps are device tensors and every decision is a fixed-shape
tensor operation: the host never reads which blocks a step wants. Misses are copied from
Tier-2 by the page-in kernel (:func:`~certkv.kernels.triton_lru.page_in`, which also keeps
these tables as :func:`lru_step` states them); wanted blocks that find
no free slot are read by Phase 2 from Tier-2 in place (slot ``-2 - row``). Hits, misses, direct
reads and host-to-device bytes are device counters, read when :meth:`counts` is asked.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

NOT_STAGED = -1  # slot map: the block is read from its codes
_NEVER = -1  # stamp of a slot never used


class DeviceLRU:
    """Up to ``capacity`` FP16 slots ``[B, d]`` for one kind (keys or values)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clock = None  # 0-d int64 device step counter
        self.pool = self.stamp = self.owner = self.slot_of = None
        self.width = 0  # blocks per kv head in ``slot_of``
        self.tally = None  # int64 [3] device counters: hits, misses, direct reads

    # ------------------------------------------------------------------ sizing
    def _ensure(self, store, n: int) -> None:
        """Size the tables to ``n`` blocks of the store (host-known sizes only): ``pool [S, B,
        d]``, ``stamp, owner [S + 1]`` (the last entry a dummy that absorbs masked scatters)
        and ``slot_of [Hkv * W + 1]`` (the last cell a dummy), growing by doubling."""
        with torch.inference_mode(False):  # updated in place by steps inside and outside it
            self._size(store, n)

    def _size(self, store, n: int) -> None:
        hkv, dev = store.num_kv_heads, store.device
        if self.pool is None:
            self.pool = torch.empty(0, store.block_size, store.head_dim, dtype=torch.float16,
                                    device=dev)
            self.stamp = torch.full((1,), _NEVER, dtype=torch.long, device=dev)
            self.owner = torch.zeros(1, dtype=torch.long, device=dev)
            self.slot_of = torch.full((1,), NOT_STAGED, dtype=torch.int32, device=dev)
            self.clock = torch.zeros((), dtype=torch.long, device=dev)
            self.tally = torch.zeros(3, dtype=torch.long, device=dev)
        if n > self.width:
            self._widen(hkv, max(2 * self.width, n))
        size, want = self.pool.shape[0], min(self.capacity, hkv * n)
        if size < want:
            self._grow(max(want, min(self.capacity, 2 * size)))

    def _widen(self, hkv: int, width: int) -> None:
        """``slot_of`` over ``width`` blocks per kv head; owners re-indexed to the new width."""
        old, old_w = self.slot_of, self.width
        grown = torch.full((hkv * width + 1,), NOT_STAGED, dtype=torch.int32,
                           device=old.device)
        if old_w:
            grown[: hkv * width].view(hkv, width)[:, :old_w] = old[: hkv * old_w].view(hkv, old_w)
        live = self.owner < hkv * old_w
        kv, blk = self.owner // max(old_w, 1), self.owner % max(old_w, 1)
        self.owner = torch.where(live, kv * width + blk, hkv * width)
        self.slot_of, self.width = grown, width

    def _grow(self, size: int) -> None:
        extra = size - self.pool.shape[0]
        dummy = self.slot_of.shape[0] - 1
        self.pool = torch.cat([self.pool, self.pool.new_empty(extra, *self.pool.shape[1:])])
        self.stamp = torch.cat([self.stamp[:-1], self.stamp.new_full((extra + 1,), _NEVER)])
        self.owner = torch.cat([self.owner[:-1], self.owner.new_full((extra + 1,), dummy)])

    # -------------------------------------------------------------------- step
    def tables(self, store, n: int | None = None) -> LRUTables:
        """The bookkeeping a step's :func:`lru_step` updates in place, sized first to ``n``
        block columns of ``store`` (its completed blocks by default; a padded layout's width,
        so that the tables keep their size while blocks complete), then fill the slots it took
        (:func:`~certkv.kernels.triton_lru.page_in`)."""
        self._ensure(store, store.num_blocks if n is None else n)
        return LRUTables(self.stamp, self.owner, self.slot_of, self.clock, self.tally)

    def counts(self) -> tuple[int, int, int]:
        """``(hits, misses, direct reads)`` so far (one host read)."""
        if self.tally is None:
            return 0, 0, 0
        hits, misses, direct = self.tally.tolist()
        return hits, misses, direct


class LRUTables(NamedTuple):
    """A :class:`DeviceLRU`'s state on the device: ``stamp, owner`` int64 ``[S + 1]`` (each
    slot's last step and ``slot_of`` cell; the last entry a dummy that masked scatters write
    to), ``slot_of`` int32 ``[Hkv * W + 1]`` (each (kv head, block)'s slot or -1; last: a
    dummy), ``clock`` (0-d int64 step counter) and ``tally`` (int64 ``[3]``: hits, misses,
    direct reads)."""

    stamp: torch.Tensor
    owner: torch.Tensor
    slot_of: torch.Tensor
    clock: torch.Tensor
    tally: torch.Tensor


def lru_step(tables: LRUTables, want: torch.Tensor, rows: torch.Tensor):
    """One step of the device-side LRU, as fixed-shape tensor operations (no host read; it can
    be compiled into a few kernels). The tables are updated in place (their storage is what a
    step captured in a graph replays on, :mod:`certkv.graphs`).

    Args:
        tables: :class:`LRUTables` before the step; want: bool ``[Hkv, n]``; rows: int64
            ``[Hkv, n]`` Tier-2 rows.
    Returns ``(tables, need [S] int8, src [S] int64, slot [Hkv, n] int32)``: the tables
    (the same tensors, updated: clock advanced, this step's hits, misses and direct reads
    tallied), the slots to fill with Tier-2 rows and the slot map (:func:`slot_maps`). Hits
    keep their slot (stamped); misses take, in (kv head, block) order, the least recently used
    slots not used this step, as the host LRU does; the rest are read from Tier-2 in place.
    """
    stamp, owner, slot_of, clock, tally = tables
    clock = clock + 1
    hkv, n = want.shape
    size, dummy_cell = stamp.shape[0] - 1, slot_of.shape[0] - 1
    width = dummy_cell // hkv
    cells = (torch.arange(hkv, device=want.device)[:, None] * width
             + torch.arange(n, device=want.device)).flatten()
    wanted, flat_rows = want.flatten(), rows.flatten()
    current = slot_of[cells].long()
    hit = wanted & (current >= 0)
    stamp = stamp.index_fill(0, torch.where(hit, current, size), clock)
    miss = wanted & (current < 0)
    used = stamp[:size] == clock
    order = torch.argsort(torch.where(used, torch.iinfo(torch.long).max, stamp[:size]),
                          stable=True)  # least recently used first, this step's last
    rank = torch.cumsum(miss, 0) - 1
    take = miss & (rank < (~used).sum())
    victim = torch.where(take, order[rank.clamp(0, max(size - 1, 0))], size) if size \
        else torch.full_like(rank, size)
    cell = torch.where(take, cells, dummy_cell)
    slot_of = slot_of.index_fill(0, torch.where(take, owner[victim], dummy_cell), NOT_STAGED)
    slot_of = slot_of.scatter(0, cell, victim.int())
    owner = owner.scatter(0, victim, cell)
    stamp = stamp.index_fill(0, victim, clock)
    need = torch.zeros(size + 1, dtype=torch.int8, device=want.device).index_fill(0, victim, 1)
    src = torch.zeros(size + 1, dtype=torch.long, device=want.device).scatter(0, victim,
                                                                              flat_rows)
    after = slot_of[cells].long()
    direct = wanted & (after < 0)
    slot = torch.where(wanted, torch.where(after >= 0, after, -2 - flat_rows), NOT_STAGED)
    tally = tally + torch.stack([hit.sum(), take.sum(), direct.sum()])
    for kept, new in zip(tables, (stamp, owner, slot_of, clock, tally), strict=True):
        kept.copy_(new)
    return tables, need[:size], src[:size], slot.int().view(hkv, n)


def slot_maps(plan: torch.Tensor, width: int, key_tables: LRUTables | None,
              value_tables: LRUTables | None):
    """A step's page-in on the device, keys and values in one pure segment.

    Args:
        plan: bool ``[2, Hkv, n]`` (FP16 keys, FP16 values wanted; only completed blocks,
            whose originals are in Tier-2, are ever wanted: the plan is False on the exact
            tail block and the empty blocks of a padded layout); width: Tier-2 rows per kv
            head (block ``b`` of kv head ``h`` is row ``h * width + b``).
        key_tables / value_tables: each LRU's :class:`LRUTables` (over at least ``n`` blocks),
            or None (no scratch cache: every wanted block is read from Tier-2 in place).
    Returns ``(maps [2, Hkv, n] int32, value_promotions (0-d), key_step, value_step)``: the
    slot maps (-1 where not wanted), how many value blocks were wanted, and per LRU
    ``(tables, need, src)`` of :func:`lru_step` or None.
    """
    hkv, n = plan.shape[1], plan.shape[2]
    rows = (torch.arange(hkv, device=plan.device)[:, None] * width
            + torch.arange(n, device=plan.device))
    maps, steps = [], []
    for wanted, tables in zip(plan.unbind(), (key_tables, value_tables), strict=True):
        if tables is None:
            maps.append(torch.where(wanted, -2 - rows, NOT_STAGED))
            steps.append(None)
        else:
            tables, need, src, slot = lru_step(tables, wanted, rows)
            maps.append(slot.long())
            steps.append((tables, need, src))
    return torch.stack(maps).int(), plan[1].sum(), steps[0], steps[1]
