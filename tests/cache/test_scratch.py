"""FP16 scratch cache: same results, LRU accounting, separate key/value capacity."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.errors import ConfigError


def store(n=256):
    k, v = make_kv(2, n, 32, seed=0)
    s = TieredKVStore(2, 32)
    s.append(k, v)
    return s, k


def test_scratch_returns_tier2_blocks_and_counts():
    s, _ = store()
    scratch = ScratchCache(key_blocks=4, value_blocks=0)
    heads, blocks = torch.tensor([0, 1, 1]), torch.tensor([3, 3, 5])
    k, v = scratch.fetch(s, heads, blocks, which="kv")
    ref_k, ref_v = s.fetch_originals(heads, blocks)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)
    assert scratch.stats.misses == 6 and scratch.stats.hits == 0
    k2, _ = scratch.fetch(s, heads, blocks, which="k")
    assert torch.equal(k2, ref_k)
    assert scratch.stats.hits == 3  # keys cached; values have capacity 0
    assert scratch.stats.h2d_bytes == 6 * 16 * 32 * 2


def test_lru_evicts_least_recently_used():
    s, _ = store()
    scratch = ScratchCache(key_blocks=2, value_blocks=2)
    for blk in (0, 1, 0, 2):  # 1 is the LRU entry when 2 arrives
        scratch.fetch(s, torch.tensor([0]), torch.tensor([blk]), which="k")
    before = scratch.stats.hits
    scratch.fetch(s, torch.tensor([0]), torch.tensor([0]), which="k")
    assert scratch.stats.hits == before + 1
    scratch.fetch(s, torch.tensor([0]), torch.tensor([1]), which="k")
    assert scratch.stats.misses == 4


def test_attention_with_scratch_is_identical_and_hits_on_the_next_step():
    s, k = store()
    q = make_query(k, 2, seed=1, scale=2.0, peaked=True)
    attn = CertifiedAttention()
    out0, cert0 = attn(q, s)
    scratch = ScratchCache(key_blocks=64, value_blocks=64)
    out1, cert1 = attn(q, s, scratch=scratch)
    assert torch.equal(out0, out1) and torch.equal(cert0.e_key, cert1.e_key)
    misses = scratch.stats.misses
    attn(q, s, scratch=scratch)
    assert scratch.stats.misses == misses and scratch.stats.hits > 0


def test_negative_capacity_rejected():
    with pytest.raises(ConfigError, match="must be >= 0"):
        ScratchCache(key_blocks=-1)


def test_stage_serves_resident_blocks_in_place_and_gathers_when_they_do_not_fit():
    s, _ = store()
    heads, blocks = torch.tensor([0, 1, 1]), torch.tensor([3, 3, 5])
    ref_k, _ = s.fetch_originals(heads, blocks)
    roomy = ScratchCache(key_blocks=4, value_blocks=4)
    data, rows = roomy.stage(s, heads, blocks, "k")
    assert data is roomy._lru["k"].buffer and torch.equal(data[rows], ref_k)  # the pool itself
    tight = ScratchCache(key_blocks=2, value_blocks=2)
    data, rows = tight.stage(s, heads, blocks, "k")
    assert rows is None and torch.equal(data, ref_k)  # a gathered copy: 3 blocks, 2 slots


@pytest.mark.parametrize("capacity", [0, 3, 4096])
def test_attention_reads_the_scratch_pool_in_place_with_the_same_result(capacity):
    from certkv.kernels.triton_backend import TritonBackend

    s, k = store(300)
    q = make_query(k, 2, seed=2, scale=3.0, peaked=True)
    expected, _ = CertifiedAttention()(q, s)
    for backend in ("torch", TritonBackend()):
        scratch = ScratchCache(key_blocks=capacity, value_blocks=capacity)
        for _ in range(2):  # misses, then hits
            out, _ = CertifiedAttention(backend=backend)(q, s, scratch=scratch)
            torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_pool_holds_no_more_slots_than_the_context_can_use():
    """The pool grows with the context (one slot per (kv head, block) at most), up to the
    configured capacity, keeping what it holds."""
    k, v = make_kv(2, 256, 32, seed=0)
    s = TieredKVStore(2, 32)
    s.append(k[:, :64], v[:, :64])  # 4 blocks per kv head
    scratch = ScratchCache(key_blocks=2048, value_blocks=12)
    heads, blocks = torch.tensor([0, 1]), torch.tensor([1, 3])
    first, _ = scratch.fetch(s, heads, blocks, which="kv")
    assert scratch._lru["k"].buffer.shape[0] == 8 and scratch._lru["v"].buffer.shape[0] == 8
    s.append(k[:, 64:], v[:, 64:])  # 16 blocks per kv head
    again, _ = scratch.fetch(s, heads, torch.tensor([1, 15]), which="kv")
    assert scratch._lru["k"].buffer.shape[0] == 32 and scratch._lru["v"].buffer.shape[0] == 12
    assert torch.equal(again[0], first[0]) and scratch.stats.hits == 2  # kept through growth


@pytest.mark.parametrize("capacity", [3, 4096])
def test_counting_in_place_reads_matches_staging_them(capacity):
    """The numba backend reads promoted values from Tier-2 in place and the cache only counts
    them (:meth:`ScratchCache.record`); the reference stages them: the same hits, misses, bytes
    and evictions over several steps, and the same outputs within rounding."""
    s, k = store(300)
    caches = {name: ScratchCache(key_blocks=capacity, value_blocks=capacity)
              for name in ("torch", "numba")}
    for seed in range(3):
        q = make_query(k, 2, seed=seed, scale=3.0, peaked=True)
        outs = {name: CertifiedAttention(backend=name)(q, s, scratch=scratch)[0]
                for name, scratch in caches.items()}
        torch.testing.assert_close(outs["numba"], outs["torch"], rtol=1e-4, atol=1e-5)
        assert caches["numba"].stats == caches["torch"].stats
    assert caches["torch"].stats.misses > 0 and caches["torch"].stats.hits > 0
    for which in "kv":
        lrus = [cache._lru[which] for cache in caches.values()]
        assert all(np.array_equal(getattr(lrus[0], name), getattr(lrus[1], name))
                   for name in ("owner", "stamp"))
        assert np.array_equal(*(lru.slot_of[:, : s.num_blocks] for lru in lrus))


@pytest.mark.parametrize("capacity", [1, 5, 12, 64])
def test_compiled_bookkeeping_matches_the_numpy_one_step_by_step(monkeypatch, capacity):
    """:func:`certkv.cache.scratch._record` (one compiled call) keeps the same slots, stamps,
    owners and counts as the NumPy :meth:`_track` and :meth:`_insert` over 40 steps of random
    requests, as the context grows, with more misses than free slots and none at all."""
    pytest.importorskip("numba")
    import certkv.cache.scratch as scratch_module

    s, _ = store(64)
    k2, v2 = make_kv(2, 256, 32, seed=1)
    rng = np.random.default_rng(capacity)
    caches = [ScratchCache(key_blocks=capacity, value_blocks=capacity) for _ in range(2)]
    for step in range(40):
        if step % 10 == 9:  # four more blocks per kv head
            s.append(k2[:, step * 6 : step * 6 + 64], v2[:, step * 6 : step * 6 + 64])
        mask = torch.from_numpy(rng.random((2, s.num_blocks)) < rng.choice([0.0, 0.2, 0.7]))
        caches[0].record(s, mask, "k")
        with monkeypatch.context() as patch:
            patch.setattr(scratch_module, "AVAILABLE", False)
            caches[1].record(s, mask, "k")
        lrus = [cache._lru["k"] for cache in caches]
        for name in ("owner", "stamp", "clock"):
            assert np.array_equal(getattr(lrus[0], name), getattr(lrus[1], name)), (step, name)
        assert np.array_equal(*(lru.slot_of[:, : s.num_blocks] for lru in lrus))
        assert caches[0].stats == caches[1].stats
    assert caches[0].stats.misses > 0 and caches[0].stats.hits > 0


@pytest.mark.parametrize("capacity", [3, 4096])
def test_what_a_cpu_scratch_would_hold_is_counted(capacity):
    """``held_bytes`` on a CPU store (Tier-2 read in place, the scratch only bookkept): the
    FP16 bytes of the blocks a device scratch of these capacities would hold, the same on both
    CPU backends, never more than the capacities allow."""
    s, k = store(300)
    caches = {name: ScratchCache(key_blocks=capacity, value_blocks=capacity)
              for name in ("torch", "numba")}
    for seed in range(3):
        q = make_query(k, 2, seed=seed, scale=3.0, peaked=True)
        for name, scratch in caches.items():
            CertifiedAttention(backend=name)(q, s, scratch=scratch)
    block = 2 * s.block_size * s.head_dim
    held = {name: c.held_bytes(s.block_size, s.head_dim) for name, c in caches.items()}
    slots = sum(int((lru.owner[:, 0] >= 0).sum()) for lru in caches["numba"]._lru.values())
    assert held["numba"] == slots * block > 0
    assert held["numba"] <= 2 * capacity * block
    assert held["torch"] == held["numba"]  # the same bookkeeping on both backends


def test_oldest_free_slots_are_a_stable_sorts_first_ones():
    """:func:`certkv.cache.scratch._oldest` (a partition of unique keys) picks the same slots in
    the same order as a stable sort of the free slots' stamps, ties and never-used slots
    (stamp -1) included, for every count from none to all of them."""
    pytest.importorskip("numba")
    from certkv.cache.scratch import _oldest

    rng = np.random.default_rng(0)
    for size in (1, 7, 64, 2048):
        stamp = rng.integers(-1, 6, size).astype(np.int64)  # few distinct stamps: many ties
        free = np.flatnonzero(stamp < 5)
        want = free[np.argsort(stamp[free], kind="stable")]
        for take in {0, 1, 3, free.size // 2, free.size}:
            assert np.array_equal(_oldest(free, stamp, take), want[:take]), (size, take)
