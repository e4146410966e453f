"""Page-in on the host path: the FP16 key and value blocks a step's plan asks for, staged from
the scratch cache or Tier-2 (paper Section 3.4's promoted blocks).

Shapes: ``plan [2, Hkv, n]`` (FP16 keys, FP16 values wanted per kv head and block).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from certkv.kernels.layout import SlotMap, StagedBlocks, StepLayout


class PagedIn(NamedTuple):
    """What a page-in gives Phase 2 and the certificate."""

    keys: object | None  # StagedBlocks or SlotMap of FP16 keys, None when none is wanted
    values: object | None  # the same for FP16 values
    paged_evicted: int | torch.Tensor  # evicted (kv head, block) pairs read from Tier-2
    promotions: int | torch.Tensor  # value blocks read in FP16


NOTHING = PagedIn(None, None, 0, 0)


def stage_blocks(backend, lay: StepLayout, plan: torch.Tensor, stage: Callable,
                 record: Callable | None) -> PagedIn:
    """Stage what the host ``plan`` asks for (``stage(kv_idx, blk_idx, which) -> (data,
    rows)``: the scratch cache, read in place by the kernels, or Tier-2). A backend that reads
    FP16 keys or values from the originals in place (its ``in_place``: keys for the PyTorch
    reference, both on the numba backend, where Tier-2 is the same memory) gets those blocks
    without data, and the scratch cache only counts them (``record(mask, which)``). The exact
    tail block is never staged."""
    store = lay.store
    dev = store.device
    in_place = backend.in_place(store)
    staged = []
    for which, mask in zip(("k", "v"), plan, strict=True):
        kv_idx, blk_idx = mask.nonzero(as_tuple=True)  # host tensors
        if kv_idx.numel() == 0:
            staged.append(None)
            continue
        if which in in_place:
            if record is not None:
                record(mask, which)
            data, rows = None, None
        else:
            data, rows = stage(kv_idx, blk_idx, which)
        staged.append(StagedBlocks(kv_idx.to(dev, non_blocking=True),
                                   blk_idx.to(dev, non_blocking=True), data, rows))
    promotions = 0 if staged[1] is None else staged[1].blocks.numel()
    return PagedIn(staged[0], staged[1], int(paged_evicted(store, plan)), promotions)


def paged_evicted(store, plan: torch.Tensor) -> torch.Tensor | int:
    """Evicted (kv head, block) pairs the page-in ``plan`` (on the host or the device) reads
    from Tier-2: a 0-d tensor on the plan's device (0 without eviction)."""
    if store.evicted_pid is None:
        return 0
    evicted = store.evicted_mask().to(plan.device, non_blocking=True)  # [completed blocks]
    return (plan[:, :, : evicted.numel()].any(dim=0) & evicted).sum()


def tier2_stage(store, kv_heads, blocks, which: str):
    """Stage ``which`` (``"k"`` or ``"v"``) blocks straight from Tier-2: ``(data, None)``."""
    k, v = store.fetch_originals(kv_heads, blocks, which=which)
    return (k if which == "k" else v), None


def on_device(scratch, lay: StepLayout, plan: torch.Tensor, no_pool: torch.Tensor) -> PagedIn:
    """The page-in without a host read, in one launch
    (:func:`on_device_batch` of one): through the scratch cache's device
    bookkeeping (misses of keys and values copied from Tier-2, blocks without a free slot read
    by Phase 2 from Tier-2 in place) or, without a scratch cache, every wanted block read from
    Tier-2 in place (``no_pool``: a one-block FP16 pool never read). Counts stay on the device
    (0-d)."""
    if lay.num_completed == 0:
        return NOTHING
    return on_device_batch([scratch], [lay], plan.contiguous()[:, None], no_pool)[2][0]


def on_device_batch(scratches: list, lays: list[StepLayout], plan: torch.Tensor,
                    no_pool: torch.Tensor) -> tuple[torch.Tensor, list, list[PagedIn]]:
    """:func:`on_device` over a batch in one launch
    (:func:`~certkv.kernels.triton_lru.page_in_batch`): ``plan [2, S, Hkv, W]``, one scratch
    cache (or None) and layout per sequence, each scratch cache its own sequence's. Returns the
    slot maps ``[2, S, Hkv, W]``, each sequence's ``(key pool, value pool, tier2)`` as Phase 2
    reads them and its :class:`PagedIn` (counts 0-d on the device)."""
    from certkv.kernels.triton_lru import page_in_batch

    rows, pools = [], []
    for scratch, lay in zip(scratches, lays, strict=True):
        store = lay.store
        if lay.num_completed:
            k2, v2, width = store.original_rows()
        else:  # no completed block: nothing is wanted, rows never read
            k2 = v2 = no_pool
            width = 0
        lrus = [None if scratch is None else scratch.device_lru(which) for which in "kv"]
        tables = [None if lru is None else lru.tables(store, lay.num_blocks) for lru in lrus]
        kinds = [no_pool if lru is None else lru.pool for lru in lrus]
        rows.append((lay.num_blocks, width, tables, kinds, (k2, v2)))
        pools.append((kinds[0], kinds[1], (k2, v2)))
    maps, wanted = page_in_batch(plan, rows)
    paged = [PagedIn(SlotMap(maps[0, s, :, :lay.num_blocks], pools[s][0]),
                     SlotMap(maps[1, s, :, :lay.num_blocks], pools[s][1]),
                     paged_evicted(lay.store, plan[:, s, :, :lay.num_blocks]), wanted[1, s])
             for s, lay in enumerate(lays)]
    return maps, pools, paged
