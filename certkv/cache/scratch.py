"""FP16 scratch cache in device memory (paper 3.1, 9.9, Tables 17-19).

Keeps recently paged-in FP16 blocks of one layer so that consecutive decode steps do not copy
the same blocks from Tier-2 again. Keys and values have separate capacities (in blocks) and
separate LRU orders. It changes no result, only where the bytes come from; it counts hits,
misses and host-to-device bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from certkv.cache.device_scratch import DeviceLRU
from certkv.certify.fused_cpu import AVAILABLE, jit
from certkv.errors import ConfigError, require


@dataclass
class ScratchStats:
    """Counters of one scratch cache (or a sum of several)."""

    hits: int = 0
    misses: int = 0
    h2d_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def __add__(self, other: ScratchStats) -> ScratchStats:
        return ScratchStats(self.hits + other.hits, self.misses + other.misses,
                            self.h2d_bytes + other.h2d_bytes)


class _LRUBlocks:
    """Up to ``capacity`` FP16 slots ``[B, d]`` for one kind (keys or values), LRU by use stamp.

    The bookkeeping is host NumPy arrays (``slot_of[kv, block]`` -> slot or -1, each slot's
    ``owner`` and ``stamp``): page-in indices are host tensors already, so lookups and evictions
    never wait for the device, and a step's lookup is a few NumPy calls rather than a dozen
    small PyTorch operators; only the FP16 ``buffer`` lives in device memory.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clock = 0
        self.buffer = None
        self.owner = np.full((0, 2), -1, np.int64)
        self.stamp = np.full(0, -1, np.int64)
        self.slot_of = np.full((0, 0), -1, np.int64)  # rows: kv heads, once sized

    def _ensure(self, store, data: bool = True, width: int = 0) -> None:
        """Size the pool to what the store can use (one slot per ``(kv head, block)`` pair, at
        most ``capacity``), growing it by doubling as the context grows; slots keep their
        indices; ``slot_of`` covers at least ``width`` blocks. Without ``data`` only the
        bookkeeping grows (:meth:`record`)."""
        want = min(self.capacity, store.num_kv_heads * store.num_blocks)
        size = self.stamp.shape[0]
        if size < want:
            extra = min(self.capacity, max(2 * size, want)) - size
            self.owner = np.concatenate([self.owner, np.full((extra, 2), -1, np.int64)])
            self.stamp = np.concatenate([self.stamp, np.full(extra, -1, np.int64)])
        if data:
            self._ensure_buffer(store)
        have, want = self.slot_of.shape[1], max(store.num_blocks, width)
        if have < want:  # one layer's cache: its kv heads never change
            grown = np.full((store.num_kv_heads, max(2 * have, want)), -1, np.int64)
            if have:
                grown[:, :have] = self.slot_of
            self.slot_of = grown

    def _ensure_buffer(self, store) -> None:
        """The FP16 pool, one ``[B, d]`` slot per bookkept slot (never an inference tensor:
        filled in place, it serves steps inside and outside ``torch.inference_mode``)."""
        with torch.inference_mode(False):
            if self.buffer is None:
                self.buffer = torch.empty(0, store.block_size, store.head_dim,
                                          dtype=torch.float16, device=store.device)
            extra = self.stamp.shape[0] - self.buffer.shape[0]
            if extra > 0:
                self.buffer = torch.cat([self.buffer, self.buffer.new_empty(
                    extra, *self.buffer.shape[1:])])

    def _track(self, store, slots: np.ndarray, stats) -> np.ndarray:
        """The LRU's bookkeeping for one step's request of blocks whose slots (-1: not cached)
        are ``slots``: stamps the hits, counts hits and misses (FP16 bytes paged in), and
        returns the misses' positions (empty when everything hit)."""
        self.clock += 1
        hit = slots >= 0
        self.stamp[slots[hit]] = self.clock
        miss = np.flatnonzero(~hit)
        _count(stats, store, slots.size - miss.size, miss.size)
        return miss

    def record(self, store, mask: np.ndarray, stats) -> None:
        """The bookkeeping of :meth:`stage` without moving data, for the blocks ``mask [Hkv,
        n]`` (bool) sets: what a device would have paged in, for a backend that reads Tier-2 in
        place (hits, misses and bytes count alike). One compiled call (:func:`_record`) where
        numba is there: the NumPy calls of :meth:`_track` and :meth:`_insert` cost about 35 us
        per kind and layer step on a CPU, for a few dozen blocks."""
        self._ensure(store, data=False, width=mask.shape[1])
        if not AVAILABLE:
            miss = self._track(store, self.slot_of[:, : mask.shape[1]][mask], stats)
            if miss.size:
                kv, blk = np.nonzero(mask)
                self._insert(kv[miss], blk[miss])
            return
        self.clock += 1
        _count(stats, store, *_record(mask, self.slot_of, self.stamp, self.owner, self.clock))

    def stage(self, store, kind: str, kv: torch.Tensor, blk: torch.Tensor, stats):
        """FP16 blocks of ``(kv[i], blk[i])`` (host indices): hits from slots, misses from
        Tier-2 into free or least recently used slots.

        Returns ``(data, rows)``: the slot buffer and each block's slot (device) when every
        block is resident, so kernels read the scratch cache in place; otherwise (more misses
        than free slots) the blocks gathered into a new ``[P, B, d]`` tensor and None.
        """
        dev = store.device
        kv, blk = (x.cpu().numpy().astype(np.int64, copy=False) for x in (kv, blk))
        self._ensure(store, data=True)
        slots = self.slot_of[kv, blk]
        miss = self._track(store, slots, stats)
        if not miss.size:
            return self.buffer, torch.from_numpy(slots).to(dev, non_blocking=True)
        k, v = store.fetch_originals(torch.from_numpy(kv[miss]), torch.from_numpy(blk[miss]),
                                     which=kind)
        fetched = k if kind == "k" else v
        self._insert(kv[miss], blk[miss], fetched)
        slots = self.slot_of[kv, blk]  # the inserted ones now have slots
        if bool((slots >= 0).all()):
            return self.buffer, torch.from_numpy(slots).to(dev, non_blocking=True)
        out = torch.empty(kv.size, store.block_size, store.head_dim, dtype=torch.float16,
                          device=dev)
        resident = np.setdiff1d(np.flatnonzero(slots >= 0), miss)  # from the buffer, the rest
        out[torch.from_numpy(resident).to(dev, non_blocking=True)] = self.buffer[  # as fetched
            torch.from_numpy(slots[resident]).to(dev, non_blocking=True)]
        out[torch.from_numpy(miss).to(dev, non_blocking=True)] = fetched
        return out, None

    def _insert(self, kv: np.ndarray, blk: np.ndarray,
                blocks: torch.Tensor | None = None) -> None:
        """Cache fetched blocks in free or least recently used slots not used this step; blocks
        that do not fit are served uncached (the paper's split-K fallback). ``blocks`` None:
        bookkeeping only."""
        free = np.flatnonzero(self.stamp < self.clock)
        take = min(free.size, kv.size)
        if take == 0:
            return
        victims = free[np.argsort(self.stamp[free], kind="stable")[:take]]
        old = self.owner[victims]
        evicted = old[:, 0] >= 0
        self.slot_of[old[evicted, 0], old[evicted, 1]] = -1
        self.slot_of[kv[:take], blk[:take]] = victims
        self.owner[victims] = np.stack([kv[:take], blk[:take]], axis=1)
        self.stamp[victims] = self.clock
        if blocks is not None:
            self.buffer[torch.from_numpy(victims).to(blocks.device, non_blocking=True)] = \
                blocks[:take]


def _count(stats: ScratchStats, store, hits: int, misses: int) -> None:
    """Add one step's ``hits`` and ``misses`` to ``stats``, each miss the FP16 bytes of one
    ``[B, d]`` block paged in."""
    stats.hits += hits
    stats.misses += misses
    stats.h2d_bytes += misses * store.block_size * store.head_dim * 2


@jit
def _oldest(free, stamp, take):
    """The ``take`` slots of ``free`` (ascending) least recently stamped, oldest first and
    equal stamps in slot order: a stable sort's first ``take`` (:meth:`_LRUBlocks._insert`)
    without sorting every free slot. Each slot's key ``(stamp + 1) S + slot`` (``S`` slots,
    stamps from -1) is unique and orders as that sort does, so a partition and a sort of the
    ``take`` smallest give the same slots: a few misses among 2,048 slots cost about 4 us, not
    40."""
    if take == 0:
        return free[:0]
    size = stamp.shape[0]
    key = (stamp[free] + 1) * size + free
    if take < key.shape[0]:
        key = np.partition(key, take - 1)[:take]
    return np.sort(key) % size


@jit
def _record(mask, slot_of, stamp, owner, clock):
    """:meth:`_LRUBlocks._track` then :meth:`_LRUBlocks._insert` (no data) for the blocks
    ``mask [Hkv, n]`` sets, in place on the bookkeeping ``slot_of [Hkv, >= n]``, ``stamp [S]``
    and ``owner [S, 2]`` at step ``clock``: hits are stamped; the misses, in row-major order,
    take the free slots (stamp below ``clock``) least recently used first (a stable order of
    their stamps), evicting their owners, while free slots last. Returns ``(hits, misses)``."""
    hits, misses = 0, 0
    for kv in range(mask.shape[0]):
        for b in range(mask.shape[1]):
            if mask[kv, b]:
                slot = slot_of[kv, b]
                if slot >= 0:
                    stamp[slot] = clock
                    hits += 1
                else:
                    misses += 1
    if misses == 0:
        return hits, misses
    free = np.flatnonzero(stamp < clock)
    victims = _oldest(free, stamp, min(free.size, misses))
    for slot in victims:  # their owners were not asked for this step (those are stamped)
        if owner[slot, 0] >= 0:
            slot_of[owner[slot, 0], owner[slot, 1]] = -1
    i = 0
    for kv in range(mask.shape[0]):
        for b in range(mask.shape[1]):
            if i < victims.size and mask[kv, b] and slot_of[kv, b] < 0:
                slot = victims[i]
                slot_of[kv, b], owner[slot, 0], owner[slot, 1] = slot, kv, b
                stamp[slot] = clock
                i += 1
    return hits, misses


@dataclass
class ScratchCache:
    """Per-layer FP16 scratch with separate key / value capacities in blocks (LRU): host
    bookkeeping for steps that read their page-in plan (:meth:`stage`), device bookkeeping for
    steps that do not (:meth:`device_lru`, :class:`~certkv.cache.device_scratch.DeviceLRU`)."""

    key_blocks: int = 2048
    value_blocks: int = 2048
    _host: ScratchStats = field(default_factory=ScratchStats, repr=False)

    def __post_init__(self) -> None:
        require(self.key_blocks >= 0 and self.value_blocks >= 0, ConfigError,
                "scratch_key_blocks and scratch_value_blocks must be >= 0 (0 disables caching).")
        self._lru = {"k": _LRUBlocks(self.key_blocks), "v": _LRUBlocks(self.value_blocks)}
        self._device: dict[str, DeviceLRU] = {}

    @property
    def stats(self) -> ScratchStats:
        """Hits, misses and host-to-device bytes of both bookkeepings (reads the device
        counters: one host read when device steps ran). A block read from Tier-2 in place
        counts as a miss."""
        total = ScratchStats(self._host.hits, self._host.misses, self._host.h2d_bytes)
        for lru in self._device.values():
            hits, misses, direct = lru.counts()
            block = 2 * lru.pool.shape[1] * lru.pool.shape[2]  # FP16 bytes of one block
            total = total + ScratchStats(hits, misses + direct, (misses + direct) * block)
        return total

    def nbytes(self) -> int:
        """Bytes of its FP16 pools now (they grow with use up to the capacities; the host
        bookkeeping aside)."""
        pools = [lru.buffer for lru in self._lru.values() if lru.buffer is not None]
        return _bytes(pools) + self._device_bytes()

    def _device_bytes(self) -> int:
        """Bytes of the device bookkeeping's FP16 pools."""
        return _bytes([lru.pool for lru in self._device.values()])

    def held_bytes(self, block_size: int, head_dim: int) -> int:
        """FP16 bytes of the blocks it holds now: the host bookkeeping's occupied slots (a CPU
        store reads Tier-2 in place and only counts: what a device scratch of these capacities
        would hold) and the device bookkeeping's pools."""
        slots = sum(int((lru.owner[:, 0] >= 0).sum()) for lru in self._lru.values())
        return slots * 2 * block_size * head_dim + self._device_bytes()

    def stage(self, store, kv_heads: torch.Tensor, blocks: torch.Tensor, which: str):
        """``(data, rows)`` for the keys (``which="k"``) or values (``"v"``) of
        ``(kv_heads[i], blocks[i])`` (host indices): see :meth:`_LRUBlocks.stage`."""
        return self._lru[which].stage(store, which, kv_heads, blocks, self._host)

    def record(self, store, mask: torch.Tensor | np.ndarray, which: str) -> None:
        """Count a request of keys (``which="k"``) or values (``"v"``) for the blocks ``mask
        [Hkv, n]`` (a host bool tensor or array) sets that the backend serves from Tier-2 in
        place (no copy): see :meth:`_LRUBlocks.record`."""
        self._lru[which].record(store, np.asarray(mask), self._host)

    def device_lru(self, which: str) -> DeviceLRU:
        """The device bookkeeping of keys (``which="k"``) or values (``"v"``): a step updates
        its :class:`~certkv.cache.device_scratch.LRUTables` without a host read."""
        if which not in self._device:
            self._device[which] = DeviceLRU(self.key_blocks if which == "k"
                                            else self.value_blocks)
        return self._device[which]

    def fetch(self, store, kv_heads: torch.Tensor, blocks: torch.Tensor, which: str = "kv"):
        """Same contract as ``TieredKVStore.fetch_originals``, served from scratch when cached.

        Indices are host tensors. Returns ``(k, v)``, each ``[P, B, d]`` FP16 on the store's
        device or ``None``.
        """
        out = []
        for kind in ("k", "v"):
            if kind not in which:
                out.append(None)
                continue
            data, rows = self.stage(store, kv_heads, blocks, kind)
            out.append(data if rows is None else data[rows])
        return out[0], out[1]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
