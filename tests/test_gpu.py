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


def test_a_certified_step_syncs_only_at_its_one_host_read():
    store, q = cuda_layer(8, 8192, 128, group=4)
    attn = CertifiedAttention(backend="triton")
    attn(q, store)  # warm-up (compilation, allocator)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            attn(q, store)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 2, [str(w.message) for w in syncs]  # the page-in plan (+ its copy)


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
    assert counts["launches"] > count_step(lambda: dense(q, store), dense)["launches"] > 0
    assert counts["host_reads"] == 2
