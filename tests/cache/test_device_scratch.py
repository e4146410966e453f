"""The scratch cache's device-side bookkeeping (issue 24) against the host LRU it mirrors:
every wanted block is served with its FP16 original (from a slot or from Tier-2 in place), and
hits and misses equal the host LRU's on random request sequences over a growing store; the
page-in kernel (issue 55) keeps the tables as the PyTorch statement of the LRU does. The
kernels run under TRITON_INTERPRET=1 here."""

from __future__ import annotations

import pytest
import torch
from helpers import examples, make_kv
from hypothesis import given, settings
from hypothesis import strategies as st

from certkv import TieredKVStore
from certkv.cache.device_scratch import DeviceLRU, slot_maps
from certkv.cache.scratch import ScratchStats, _LRUBlocks
from certkv.kernels.triton_lru import page_in


def served(lru: DeviceLRU, slot: torch.Tensor, tier2: torch.Tensor, h: int, b: int):
    """The FP16 block Phase 2 reads for ``(h, b)`` under slot map ``slot``."""
    s = int(slot[h, b])
    return lru.pool[s] if s >= 0 else tier2[-2 - s]


def page_in_keys(lru: DeviceLRU, store, want: torch.Tensor):
    """One step's key page-in as the attention step runs it (one launch of
    :func:`~certkv.kernels.triton_lru.page_in` on the LRU's tables, updated in place):
    ``(slot map [Hkv, n], Tier-2 rows)``."""
    k2, v2, width = store.original_rows()
    plan = torch.stack([want, torch.zeros_like(want)])
    tables = [lru.tables(store, want.shape[1]), None]
    maps, wanted = page_in(plan, width, tables, [lru.pool, lru.pool], (k2, v2))
    assert wanted.tolist() == [int(want.sum()), 0]
    return maps[0], k2


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(0, 12), hkv=st.integers(1, 3),
       steps=st.integers(1, 6), density=st.floats(0.05, 0.9))
def test_the_page_in_kernel_keeps_the_tables_as_lru_step_states_them(seed, capacity, hkv,
                                                                     steps, density):
    """The kernel against the PyTorch statement of the LRU (:func:`slot_maps`, the reference):
    the same slot maps and the same tables (stamps, owners, slot table, clock, tallies; the
    entries that absorb masked scatters aside) after every step, keys and values with
    different capacities in one launch."""
    gen = torch.Generator().manual_seed(seed)
    k, v = make_kv(hkv, 40 + 16 * steps, 16, seed=seed)
    store = TieredKVStore(hkv, 16, block_size=8, value_group=8)
    store.append(k[:, :40], v[:, :40])
    kernel = [DeviceLRU(capacity), DeviceLRU(capacity + 3)]
    reference = [DeviceLRU(capacity), DeviceLRU(capacity + 3)]
    for step in range(steps):
        n = store.num_blocks
        plan = torch.rand(2, hkv, n, generator=gen) < density
        k2, v2, width = store.original_rows()
        got, wanted = page_in(plan, width, [lru.tables(store, n) for lru in kernel],
                              [lru.pool for lru in kernel], (k2, v2))
        want, promotions, *_ = slot_maps(plan, width, *(lru.tables(store, n)
                                                        for lru in reference))
        assert torch.equal(got, want) and int(wanted[1]) == int(promotions), step
        for a, b in zip(kernel, reference, strict=True):  # the dummy entries aside
            (*tables_a, clock_a, tally_a), (*tables_b, clock_b, tally_b) = (
                lru.tables(store, n) for lru in (a, b))
            assert all(torch.equal(x[:-1], y[:-1]) for x, y in zip(tables_a, tables_b,
                                                                    strict=True)), step
            assert torch.equal(clock_a, clock_b) and torch.equal(tally_a, tally_b), step
        start = 40 + 16 * step
        store.append(k[:, start:start + 16], v[:, start:start + 16])


@settings(max_examples=examples(25), deadline=None)
@given(seed=st.integers(0, 10_000), capacity=st.integers(0, 12), hkv=st.integers(1, 3),
       steps=st.integers(1, 6), density=st.floats(0.05, 0.9))
def test_device_lru_serves_every_block_and_counts_like_the_host_lru(seed, capacity, hkv,
                                                                      steps, density):
    gen = torch.Generator().manual_seed(seed)
    k, v = make_kv(hkv, 40 + 16 * steps, 16, seed=seed)
    store = TieredKVStore(hkv, 16, block_size=8, value_group=8)
    store.append(k[:, :40], v[:, :40])
    device, host, stats = DeviceLRU(capacity), _LRUBlocks(capacity), ScratchStats()
    for step in range(steps):
        n = store.num_blocks
        want = torch.rand(hkv, n, generator=gen) < density
        slot, k2 = page_in_keys(device, store, want)
        originals = store.dense_kv()[0][:, : n * 8].reshape(hkv, n, 8, 16)
        for h, b in want.nonzero().tolist():
            assert torch.equal(served(device, slot, k2, h, b), originals[h, b])
        assert (slot[~want] == -1).all()
        kv, blk = want.nonzero(as_tuple=True)
        if kv.numel():
            host.stage(store, "k", kv, blk, stats)
        hits, misses, direct = device.counts()
        assert (hits, misses + direct) == (stats.hits, stats.misses), step
        start = 40 + 16 * step  # grow across block boundaries between steps
        store.append(k[:, start:start + 16], v[:, start:start + 16])


@pytest.mark.parametrize("backend", ["triton", "torch"])  # device and host bookkeeping
def test_tables_made_under_inference_mode_serve_steps_outside_it(backend):
    """A decode under ``torch.inference_mode`` (as ``certkv run``) then a plain call: neither
    bookkeeping's tables trip "inplace update to inference tensor" (the host LRU did)."""
    from helpers import make_query

    from certkv import CertifiedAttention
    from certkv.cache.scratch import ScratchCache

    k, v = make_kv(2, 200, 32, seed=3)
    store = TieredKVStore(2, 32, value_group=8)
    store.append(k, v)
    attention, scratch = CertifiedAttention(backend=backend), ScratchCache(8, 8)
    with torch.inference_mode():
        attention(make_query(k, 3, seed=1, scale=3.0), store, scratch=scratch)
    attention(make_query(k, 3, seed=2, scale=3.0), store, scratch=scratch)
    assert scratch.stats.hits > 0
