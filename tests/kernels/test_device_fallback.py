"""Rungs 3-4 without a host read (issue 24): the one-launch fallback kernel against the dense
path, the certificate contract on steps with dense heads (FP64 oracle, no allowance), the host
reads of such a step, and non-finite inputs raised at the next synchronization with the step's
certificate invalid. Under TRITON_INTERPRET=1 on CPU (Tier-2 is ordinary memory there, so the
kernel reads it as it reads pinned memory on CUDA)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import check_heads, make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.certificate import CertificateLog
from certkv.certify.ladder import Ladder
from certkv.errors import ConfigError, NonFiniteError
from certkv.kernels.reference import prescaled_attention
from certkv.kernels.triton_fallback import dense_flagged

SCALING = 32**-0.5


def layer(tokens=200, seed=0, group=3, peaked=True):
    k, v = make_kv(2, tokens, 32, seed=seed, outlier_channels=2)
    store = TieredKVStore(2, 32, value_group=8)
    store.append(k, v)
    return store, make_query(k, group, seed=seed, scale=4.0, peaked=peaked)


@pytest.mark.parametrize("tokens", [5, 16, 75, 200])  # tail only, blocks only, both
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_kernel_is_dense_attention_on_flagged_heads_and_leaves_the_others(tokens, dtype):
    store, q = layer(tokens, seed=tokens, group=3)
    q = q.to(dtype)
    flags = torch.tensor([True, False, False, False, True, True])  # one group partly flagged
    out = torch.full((6, 32), 7.0)
    dense_flagged(q, flags, store.originals(), store.tail_buffers(),
                  store.block_counts(), out, SCALING)
    k, v = store.dense_kv()
    want = prescaled_attention(q.float(), k, v, SCALING)
    assert torch.allclose(out[flags], want[flags], rtol=1e-5, atol=1e-6)
    assert (out[~flags] == 7.0).all()


def test_huge_queries_do_not_overflow_the_kernel():
    store, q = layer(75, seed=1)
    q = q * 1e30  # |q . k| beyond FP32 without the prescaling
    out = torch.zeros(6, 32)
    dense_flagged(q, torch.ones(6, dtype=torch.bool), store.originals(),
                  store.tail_buffers(), store.block_counts(), out, SCALING)
    k, v = store.dense_kv()
    assert torch.isfinite(out).all()
    assert torch.allclose(out, prescaled_attention(q, k, v, SCALING), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("seed", "r"), [(0, 2), (4, 2), (1, 3), (5, 3), (0, 3)])
def test_the_contract_holds_with_dense_heads_recomputed_on_the_device(seed, r):
    """Some heads on rungs 3-4 (ranking of the top ``r`` fails), some not: every head within its
    bound of the FP64 reference; the same rungs as the host-read path."""
    store, q = layer(200, seed=seed, peaked=seed % 2 == 0)
    ladder = Ladder(r=r)
    on_device = CertifiedAttention(backend="triton", ladder=ladder)
    out, cert = on_device(q, store)
    assert on_device._on_device(q, tolerant=None)
    assert (cert.rung >= 3).any()
    check_heads(out, cert, q, store)
    out_host, cert_host = CertifiedAttention(backend="triton", ladder=ladder,
                                             device_fallback=False)(q, store)
    assert torch.equal(cert.rung, cert_host.rung)
    fast = cert.rung < 3
    assert torch.equal(out[fast], out_host[fast])
    assert torch.allclose(out, out_host, rtol=1e-5, atol=1e-6)


def test_a_step_with_dense_heads_and_scratch_misses_never_reads_the_host(audit):
    """Issue 24's target: page-in plan, scratch bookkeeping and fallback flags all stay on the
    device (0 reads, no operation that would wait for it)."""
    auditor, reads = audit
    store, q = layer(200, seed=5, peaked=False)
    attn = CertifiedAttention(backend="triton", ladder=Ladder(r=3))
    scratch = ScratchCache(key_blocks=2, value_blocks=2)  # too small: misses every step
    for _ in range(2):
        reads.clear()
        with auditor:
            _out, cert = attn(q, store, scratch=scratch)
        assert auditor.stalls == []
        assert reads == []
    assert (cert.rung >= 3).any() and (cert.rung < 3).any()
    stats = scratch.stats  # read after the steps
    assert stats.hits > 0 and stats.misses > 0


@pytest.mark.parametrize("mode", ["certified", "naive"])
def test_the_step_counter_sees_no_host_read_on_the_triton_backend(mode):
    """What `certkv bench attention` reports for a Triton step (the torch path reads twice)."""
    from certkv.opcount import count_step

    store, q = layer(200, seed=5, peaked=False)
    attn = CertifiedAttention(backend="triton", mode=mode, ladder=Ladder(r=3))
    scratch = ScratchCache(8, 8)
    attn(q, store, scratch=scratch)
    assert count_step(lambda: attn(q, store, scratch=scratch), attn)["host_reads"] == 0


def decode(attn, store, q, steps, scratch, seed=0):
    """``steps`` decode steps with a new token appended after each: outputs and certificates."""
    gen = torch.Generator().manual_seed(seed)
    results = []
    for _ in range(steps):
        results.append(attn(q, store, scratch=scratch))
        k, v = (torch.randn(2, 1, 32, generator=gen) for _ in range(2))
        store.append(k, v)
    return results


@pytest.mark.parametrize("capacity", [None, 0, 3, 40])
def test_paging_in_on_the_device_equals_the_host_page_in(capacity):
    """Same FP16 blocks, same order of reads: identical outputs, key and value terms equal up to
    the segment's FP32 rounding, and
    the same scratch hits and misses as the host-side LRU (blocks without a free slot count as
    misses in both; 40 holds every block), over steps that grow the store across a block
    boundary (12 blocks and a tail of 13 tokens: the third token appended completes block 13)."""
    runs = []
    for device_fallback in (True, False):
        store, q = layer(205, seed=3, peaked=False)
        scratch = None if capacity is None else ScratchCache(capacity, capacity)
        # the device path's certificate comes from Phase 2's merge (FP64, rounded once), the
        # host path's from the PyTorch segment (FP32): equal up to the segment's rounding
        attn = CertifiedAttention(backend="triton", device_fallback=device_fallback,
                                  compile=False)
        runs.append((decode(attn, store, q, 6, scratch), scratch))
    (device, dev_scratch), (host, host_scratch) = runs
    for (out_d, cert_d), (out_h, cert_h) in zip(device, host, strict=True):
        assert int(cert_d.value_promotions) == cert_h.value_promotions > 0
        assert torch.equal(cert_d.k_star, cert_h.k_star) and torch.equal(cert_d.rung, cert_h.rung)
        fast = cert_h.rung < 3
        assert torch.equal(out_d[fast], out_h[fast])
        for name in ("e_key", "e_val"):
            torch.testing.assert_close(getattr(cert_d, name)[fast], getattr(cert_h, name)[fast],
                                       rtol=1e-5, atol=0)
        # the device path's arithmetic coefficients count the layout's n B token slots (a
        # captured step replays them as the tail fills): never below the host path's
        e_d, e_h = cert_d.e_arith[fast], cert_h.e_arith[fast]
        assert (e_d >= e_h).all() and torch.allclose(e_d, e_h, rtol=1e-2, atol=0)
    if capacity is not None:
        assert dev_scratch.stats == host_scratch.stats
        assert dev_scratch.stats.hits > 0 or capacity == 0


def test_the_contract_holds_with_evicted_blocks_paged_in_on_the_device():
    from certkv.evict import StreamingEviction
    from certkv.quant import GroupAffineValueCodec, KVQuantizer

    k, v = make_kv(2, 300, 32, seed=6, outlier_channels=2)
    quantizer = KVQuantizer(value_codec=GroupAffineValueCodec(bits=4, group=8))
    store = TieredKVStore(2, 32, quantizer=quantizer.with_eviction(
        StreamingEviction(budget=0.3, sink=4)))
    store.append(k, v)
    q = make_query(k, 3, seed=6, scale=4.0, peaked=True)
    attn = CertifiedAttention(backend="triton")
    scratch = ScratchCache(8, 8)
    for _out, cert in decode(attn, store, q, 3, scratch):
        assert int(cert.paged_evicted) > 0
    out, cert = attn(q, store, scratch=scratch)
    check_heads(out, cert, q, store)
    summary = cert.summary()
    assert isinstance(summary["paged_evicted"], int) and summary["paged_evicted"] > 0
    log = CertificateLog(keep="full")  # per-head records skip the step's counts
    for layer in range(2):
        log.record(layer, cert)
    log.flush()
    assert log.steps[0]["paged_evicted"] == 2 * summary["paged_evicted"]
    assert len(log.heads) == 12 and "paged_evicted" not in log.heads[0]


@pytest.mark.parametrize("bad", ["q", "kv"])
def test_nonfinite_input_invalidates_the_step_and_raises_at_synchronize(bad):
    store, q = layer(100, seed=2)
    if bad == "q":
        q = q.clone()
        q[1, 3] = float("nan")
    else:  # what a CUDA store records for a NaN append (a CPU store raises at the append)
        store._nonfinite = torch.tensor(True)
    attn = CertifiedAttention(backend="triton")
    _out, cert = attn(q, store)  # no raise, no host read at the step
    assert not torch.isfinite(cert.bound).any()  # never a silently certified NaN
    log = CertificateLog()
    log.record(0, cert)
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        log.flush()  # the transformers cache's step boundary
    match = "q holds NaN" if bad == "q" else "k or v holds NaN"
    with pytest.raises(NonFiniteError, match=match):
        attn.synchronize()
    attn.synchronize()  # reported once


def test_synchronize_without_steps_or_bad_input_is_silent():
    attn = CertifiedAttention(backend="triton")
    attn.synchronize()
    store, q = layer(60)
    _out, cert = attn(q, store)
    assert math.isfinite(float(cert.bound.max()))
    attn.synchronize()


def test_the_host_path_stays_where_the_device_path_cannot_serve():
    store, q = layer(60)
    tolerant = CertifiedAttention(backend="triton", ladder=Ladder(bound_tol=0.05))
    assert not tolerant._on_device(q, tolerant=True)
    assert not CertifiedAttention(backend="torch")._on_device(q, tolerant=False)
    assert not CertifiedAttention(backend="triton")._on_device(q.double(), tolerant=False)
    with pytest.raises(ConfigError, match="device_fallback=True needs backend=triton"):
        CertifiedAttention(backend="torch", device_fallback=True)(q, store)
