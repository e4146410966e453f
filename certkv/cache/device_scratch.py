"""The FP16 scratch cache with its bookkeeping in device memory (issue 24).

The same cache as :class:`~certkv.cache.scratch.ScratchCache`'s host LRU (paper 3.1; separate
key / value capacities, least recently used slot first, never a slot used this step), but the
slot table, owners and use stamps are device tensors and every decision is a fixed-shape
tensor operation: the host never reads which blocks a step wants. Misses are copied from
Tier-2 by one kernel (:func:`~certkv.kernels.triton_pagein.fill_slots`); wanted blocks that find
no free slot are read by Phase 2 from Tier-2 in place (slot ``-2 - row``). Hits, misses, direct
reads and host-to-device bytes are device counters, read when :meth:`counts` is asked.
"""

from __future__ import annotations

import torch

NOT_STAGED = -1  # slot map: the block is read from its codes
_NEVER = -1  # stamp of a slot never used


class DeviceLRU:
    """Up to ``capacity`` FP16 slots ``[B, d]`` for one kind (keys or values)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clock = 0  # host counter of steps (never read from the device)
        self.pool = self.stamp = self.owner = self.slot_of = None
        self.width = 0  # blocks per kv head in ``slot_of``
        self.hits = self.misses = self.direct = None  # 0-d int64 device counters

    # ------------------------------------------------------------------ sizing
    def _ensure(self, store) -> None:
        """Size the tables to the store (host-known sizes only): ``pool [S, B, d]``,
        ``stamp, owner [S + 1]`` (the last entry a dummy that absorbs masked scatters) and
        ``slot_of [Hkv * W + 1]`` (the last cell a dummy), growing by doubling."""
        hkv, n, dev = store.num_kv_heads, store.num_blocks, store.device
        if self.pool is None:
            self.pool = torch.empty(0, store.block_size, store.head_dim, dtype=torch.float16,
                                    device=dev)
            self.stamp = torch.full((1,), _NEVER, dtype=torch.long, device=dev)
            self.owner = torch.zeros(1, dtype=torch.long, device=dev)
            self.slot_of = torch.full((1,), NOT_STAGED, dtype=torch.int32, device=dev)
            self.hits, self.misses, self.direct = (torch.zeros((), dtype=torch.long, device=dev)
                                                   for _ in range(3))
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
    def slots(self, store, want: torch.Tensor, rows: torch.Tensor, tier2: torch.Tensor
              ) -> torch.Tensor:
        """The slot map ``[Hkv, n]`` (int32) of one step's wanted blocks, pool filled.

        Args:
            want: bool ``[Hkv, n]`` on the device: blocks to read in FP16 (completed blocks).
            rows: int64 ``[Hkv, n]``: each block's row in ``tier2``.
            tier2: FP16 ``[R, B, d]`` row view of the originals (read in place).
        Returns: the block's pool slot (``>= 0``), ``-2 - row`` for a wanted block read from
        Tier-2 in place (no free slot this step), or -1 (not wanted). No host read.
        """
        from certkv.kernels.triton_pagein import fill_slots

        self._ensure(store)
        self.clock += 1
        hkv, n = want.shape
        size, dummy_slot, dummy_cell = self.pool.shape[0], self.pool.shape[0], hkv * self.width
        cells = (torch.arange(hkv, device=want.device)[:, None] * self.width
                 + torch.arange(n, device=want.device)).flatten()
        wanted = want.flatten()
        current = self.slot_of[cells].long()
        hit = wanted & (current >= 0)
        self.stamp.index_fill_(0, torch.where(hit, current, dummy_slot), self.clock)
        miss = wanted & (current < 0)
        used = self.stamp[:size] == self.clock
        order = torch.argsort(torch.where(used, torch.iinfo(torch.long).max,
                                          self.stamp[:size]), stable=True)  # LRU first
        rank = torch.cumsum(miss, 0) - 1
        take = miss & (rank < (~used).sum())
        victim = torch.where(take, order[rank.clamp(0, max(size - 1, 0))] if size else rank,
                             dummy_slot)
        evicted = torch.where(take, self.owner[victim], dummy_cell)
        self.slot_of.index_fill_(0, evicted, NOT_STAGED)
        self.slot_of.scatter_(0, torch.where(take, cells, dummy_cell), victim.int())
        self.owner.scatter_(0, victim, torch.where(take, cells, dummy_cell))
        self.stamp.index_fill_(0, victim, self.clock)
        need = torch.zeros(size + 1, dtype=torch.int8, device=want.device)
        need.index_fill_(0, victim, 1)
        src = torch.zeros(size + 1, dtype=torch.long, device=want.device)
        src.scatter_(0, victim, rows.flatten())
        fill_slots(need[:size], src[:size], tier2, self.pool)
        after = self.slot_of[cells].long()
        direct = wanted & (after < 0)
        self.hits += hit.sum()
        self.misses += take.sum()
        self.direct += direct.sum()
        slot = torch.where(after >= 0, after, -2 - rows.flatten())
        return torch.where(wanted, slot, NOT_STAGED).int().view(hkv, n)

    def counts(self) -> tuple[int, int, int]:
        """``(hits, misses, direct reads)`` so far (one host read)."""
        if self.hits is None:
            return 0, 0, 0
        return tuple(int(x) for x in torch.stack([self.hits, self.misses, self.direct]).cpu())
