"""CUDA: the same store and contract on the GPU (skipped without CUDA)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import check_heads, cuda_layer, make_kv

from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import NonFiniteError

pytestmark = pytest.mark.gpu


def test_tier2_is_pinned_host_memory_and_tier1_on_device():
    k, v = make_kv(2, 64, 32, seed=0)
    store = TieredKVStore(2, 32, device="cuda")
    store.append(k.cuda(), v.cuda())
    assert store.key_blocks()["codes"].is_cuda
    assert store._tier2.view()["k"].is_pinned()


@pytest.mark.parametrize("context", [1000, 16384])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("mode", ["certified", "naive", "dense"])
def test_contract_on_cuda(context, dtype, mode):
    """Every head within its bound on the GPU, with no allowance: the Triton kernels, the
    compiled segments and, for FP16 queries, the dense path's FP16 SDPA (its e_arith model
    assumes FP32 logits and softmax, FP16 weights: checked here)."""
    store, q = cuda_layer(4, context, 128, group=4)
    q = q.to(dtype)
    out, cert = CertifiedAttention(mode=mode)(q, store)
    check_heads(out, cert, q, store)


def test_nonfinite_kv_on_cuda_is_reported_at_the_next_synchronization_without_a_sync_per_append():
    k, v = make_kv(2, 64, 32, seed=0)
    store = TieredKVStore(2, 32, device="cuda")
    store.append(k.cuda(), v.cuda())
    bad = torch.full((2, 1, 32), float("nan"), device="cuda")
    store.append(bad, bad)  # deferred: no device sync here
    attn = CertifiedAttention()  # triton on CUDA: rungs 3-4 from the flags on the device
    _out, cert = attn(torch.randn(4, 32, device="cuda"), store)
    assert not torch.isfinite(cert.bound).any()  # the step's certificate is invalid
    with pytest.raises(NonFiniteError, match="k or v holds NaN or Inf"):
        attn.synchronize()
    with pytest.raises(NonFiniteError, match="k or v holds NaN or Inf"):
        CertifiedAttention(device_fallback=False)(torch.randn(4, 32, device="cuda"), store)


@pytest.mark.parametrize("scratch", [False, True])
def test_a_certified_step_never_syncs(scratch):
    """Page-in (the scratch cache's device bookkeeping, or Tier-2 read in place) and rungs 3-4
    stay on the device (issue 24)."""
    from certkv.cache.scratch import ScratchCache

    store, q = cuda_layer(8, 8192, 128, group=4)
    attn = CertifiedAttention(backend="triton")
    cache = ScratchCache() if scratch else None
    check_heads(*attn(q, store, scratch=cache), q, store)  # warm-up (compilation, allocator)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            attn(q, store, scratch=cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # torch's warning per synchronizing call (its notice that the mode is a prototype is not one)
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert syncs == [], [str(w.message) for w in syncs]  # page-in and fallback on the device


def test_paging_in_on_the_device_equals_the_host_page_in_on_cuda():
    """Full size: the device-side scratch (UVA fill kernel, direct Tier-2 reads for overflow)
    gives the host page-in's outputs on fast heads and the contract on all (issue 24)."""
    from certkv.cache.scratch import ScratchCache

    store, q = cuda_layer(8, 8192, 128, group=4)
    results = []
    for device_fallback in (True, False):
        attn = CertifiedAttention(backend="triton", device_fallback=device_fallback)
        scratch = ScratchCache(64, 64)  # small: hits, misses and direct reads
        for _ in range(3):
            out, cert = attn(q, store, scratch=scratch)
        check_heads(out, cert, q, store)
        results.append((out, cert, scratch.stats))
    (out_d, cert_d, stats_d), (out_h, cert_h, stats_h) = results
    fast = cert_h.rung < 3
    assert torch.equal(cert_d.rung, cert_h.rung) and torch.equal(out_d[fast], out_h[fast])
    assert stats_d == stats_h


def test_tier2_reads_wait_for_the_asynchronous_copies_into_pinned_memory():
    k, v = make_kv(2, 4096, 64, seed=3)
    store = TieredKVStore(2, 64, device="cuda")
    for start in range(0, 4096, 512):  # several appends, no step (no host read) in between
        store.append(k[:, start:start + 512].cuda(), v[:, start:start + 512].cuda())
    dk, dv = store.dense_kv()
    assert torch.equal(dk.cpu(), k.half()) and torch.equal(dv.cpu(), v.half())


def test_the_step_counter_counts_kernel_launches_on_cuda():
    from certkv.opcount import count_step

    store, q = cuda_layer(8, 8192, 128, group=4)
    attn = CertifiedAttention(backend="triton")
    attn(q, store)
    counts = count_step(lambda: attn(q, store), attn)
    dense = CertifiedAttention(mode="dense")
    dense(q, store)
    # every Triton launch is a CUDA launch, and a compiled segment at least one
    assert counts["launches"] >= counts["kernels"] + counts["segments"] > 0
    assert count_step(lambda: dense(q, store), dense)["launches"] > 0
    assert counts["host_reads"] == 0  # page-in and fallback on the device (issue 24)


@pytest.mark.parametrize("scratch", [True, False])
def test_cuda_graph_replays_equal_eager_steps_with_the_contract(scratch):
    """Issue 24's CUDA graphs: a layer's certified step captured once per bucket and replayed
    while the tail fills and across block completions equals the eager step over the same
    padded layout (same store, same appends), and every replayed head is within its bound."""
    from certkv.cache.scratch import ScratchCache
    from certkv.graphs import GraphedAttention

    stores, qs = zip(*(cuda_layer(4, 4000, 128, group=4) for _ in range(2)), strict=True)
    caches = [ScratchCache(64, 64) if scratch else None for _ in range(2)]
    eager = CertifiedAttention()
    eager.pad_layout = True
    graphed = GraphedAttention(CertifiedAttention())
    q = qs[0]
    gen = torch.Generator(device="cuda").manual_seed(0)
    buckets: dict = {}  # graph signature -> block counts replayed under it
    for step in range(3 * stores[0].block_size):
        k, v = (torch.randn(4, 1, 128, device="cuda", generator=gen).half() for _ in range(2))
        for store in stores:
            store.append(k, v)
        q = q + 0.05 * torch.randn(q.shape, device="cuda", generator=gen)
        out_e, cert_e = eager(q, stores[0], scratch=caches[0])
        out_g, cert_g = graphed(q, stores[1], scratch=caches[1])
        assert torch.equal(out_e, out_g) and torch.equal(cert_e.bound, cert_g.bound), step
        assert cert_e.num_blocks == cert_g.num_blocks
        check_heads(out_g, cert_g, q, stores[1])
        buckets.setdefault(stores[1].graph_signature(), set()).add(stores[1].num_blocks)
    assert graphed.captures == len(buckets)
    assert max(len(blocks) for blocks in buckets.values()) >= 2  # through a completion


def test_a_model_decode_step_captured_whole_in_a_cuda_graph_replays_as_eager():
    """Issue 24's whole-model capture on CUDA (GraphedDecode with CudaGraph): a tiny model's
    decode steps, each captured once per bucket and replayed through block completions (the
    commits deferred to between steps), give the eager padded, deferring steps' logits and
    step log."""
    from helpers.models import greedy_decode, tiny_model

    from certkv.graphs import GraphedAttention, GraphedDecode
    from certkv.models.hf_cache import CacheSpec, TieredCache
    from certkv.quant import KVQuantizer

    _, model = tiny_model()
    model = model.cuda().half()
    ids = torch.randint(0, 512, (1, 27), generator=torch.Generator().manual_seed(0)).cuda()
    runs = []
    for graphed in (False, True):
        attn = CertifiedAttention()
        attn.pad_layout = True
        cache = TieredCache(2, GraphedAttention(attn) if graphed else attn,
                            KVQuantizer(block_size=8), CacheSpec(4, 4))
        cache.defer_commit = True  # as GraphedDecode sets it
        decode = GraphedDecode(model, cache) if graphed else None
        runs.append((greedy_decode(model, cache, ids, 40, decode), cache.log.steps))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
    assert decode.captures >= 2 and decode.replays == 40 - 2 * decode.captures


def test_a_batch_decode_step_captured_whole_in_a_cuda_graph_replays_as_eager():
    """A batch's whole decode step on CUDA (GraphedDecode with CudaGraph over joined caches,
    each sequence at its own position, one leaving midway): the replayed steps give the eager
    batched steps' logits and every sequence's step log."""
    from helpers.models import decode_a_batch, tiny_model

    _, model = tiny_model()
    model = model.cuda().half()
    eager = decode_a_batch(model, CertifiedAttention(), device="cuda")
    graphed = decode_a_batch(model, CertifiedAttention(), graphed=True, device="cuda")
    assert all(torch.equal(a, b) for a, b in zip(eager.logits, graphed.logits, strict=True))
    assert eager.logs == graphed.logs and graphed.decode.replays > 0


def test_a_batch_steps_in_six_launches_without_a_sync_on_cuda():
    """A batch of ragged CUDA sequences (8K tokens down to 40) in one batched device step:
    six Triton launches whatever its size, no host read, no synchronizing call, every
    (sequence, head) within the contract."""
    from certkv.cache.scratch import ScratchCache
    from certkv.opcount import count_step

    layers = [cuda_layer(8, n, 128, group=4, seed=s) for s, n in enumerate((8192, 3000, 700, 40))]
    stores, q = [s for s, _ in layers], torch.stack([q for _, q in layers])
    scratches = [ScratchCache() for _ in stores]
    attn = CertifiedAttention(backend="triton")
    out, certs = attn.batch(q, stores, scratches=scratches)  # warm-up (compilation, allocator)
    for i, store in enumerate(stores):
        check_heads(out[i], certs[i], q[i], store)
    counts = count_step(lambda: attn.batch(q, stores, scratches=scratches), attn)
    assert counts["kernels"] == 6 and counts["host_reads"] == 0 and counts["segments"] == 0
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            attn.batch(q, stores, scratches=scratches)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "called a synchronizing" in str(w.message)]
    assert syncs == [], [str(w.message) for w in syncs]
