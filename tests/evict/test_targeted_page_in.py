"""Targeted page-in (``ladder.page_in_budget``, issue 56): a head whose boundary check (eq. 18)
fails because of evicted blocks reads the FP16 keys and values of the blocks that break it and
is checked again before rung 3; the bound holds either way."""

from __future__ import annotations

import pytest
from helpers import check_heads, make_kv, make_query

from certkv import CertifiedAttention, Ladder, TieredKVStore
from certkv.errors import ConfigError
from certkv.evict import StreamingEviction
from certkv.kernels.numba_backend import NumbaBackend
from certkv.kernels.reference import TorchBackend
from certkv.kernels.triton_backend import TritonBackend
from certkv.quant import KVQuantizer
from certkv.registry import SUMMARIES

D = 32
HOST = [TorchBackend, NumbaBackend]  # the host path, where targeted page-in runs


def evicted_store(summary="box", device="cpu", budget=0.3):
    """256 tokens with outlier channels, all but a sink and the newest blocks evicted."""
    policy = StreamingEviction(budget=budget, sink=16, summary=summary)
    store = TieredKVStore(2, D, block_size=16, device=device,
                          quantizer=KVQuantizer(block_size=16).with_eviction(policy))
    k, v = make_kv(2, 256, D, seed=4, outlier_channels=2)
    store.append(k.to(device), v.to(device))
    return store, k


def steps(store, k, budget, backend, device="cpu"):
    attn = CertifiedAttention(backend=backend(), ladder=Ladder(page_in_budget=budget))
    certs = []
    for seed in range(6):
        q = make_query(k, 2, seed=seed, scale=3.0, peaked=True).to(device)
        out, cert = attn(q, store)
        check_heads(out, cert, q, store)  # the contract, with or without the page-in
        certs.append(cert)
    return certs


@pytest.mark.parametrize("backend", HOST)
def test_a_failed_boundary_check_is_mended_instead_of_dense(backend):
    """Off (budget 0), heads whose evicted blocks' upper bounds break eq. 18 go dense; on, the
    breaking blocks are read and those heads are checked again: fewer head-steps on rung 3, and
    the certificate counts the pairs read and the heads mended."""
    store, k = evicted_store()
    assert store.evicted_mask().any()
    off = steps(store, k, 0, backend)
    on = steps(store, k, None, backend)
    failed = sum(int((~c.boundary_ok).sum()) for c in off)
    assert failed > 0, "the draw never failed eq. 18: nothing to mend"
    assert sum(c.mended for c in on) > 0 and sum(c.targeted for c in on) > 0
    assert all(c.targeted == 0 and c.mended == 0 for c in off)
    dense = [sum(int((c.rung >= 3).sum()) for c in certs) for certs in (off, on)]
    assert dense[1] < dense[0]


@pytest.mark.parametrize("backend", HOST)
def test_the_page_in_budget_caps_what_a_step_reads(backend):
    """With a budget of 1 a step reads at most one new (kv head, block) pair for it."""
    store, k = evicted_store()
    certs = steps(store, k, 1, backend)
    assert all(c.targeted <= 1 for c in certs) and any(c.targeted == 1 for c in certs)


def test_the_device_path_goes_to_rung_3_as_before():
    """The Triton kernels' step reads no host value, so it cannot decide on a second pass:
    there a failed boundary check is rung 3 whatever the budget (and the bound holds)."""
    store, k = evicted_store()
    certs = steps(store, k, None, lambda: TritonBackend(split=4))
    assert all(c.targeted == 0 and c.mended == 0 for c in certs)


@pytest.mark.parametrize("summary", SUMMARIES.names())
@pytest.mark.parametrize("backend", HOST)
def test_every_summary_keeps_the_contract_with_targeted_page_in(summary, backend):
    """Each summary in the registry, stepped with targeted page-in on (at a budget every
    summary fits)."""
    store, k = evicted_store(summary, budget=0.5)
    assert store.evicted_mask().any()
    steps(store, k, None, backend)


@pytest.mark.parametrize("summary", SUMMARIES.names())
@pytest.mark.parametrize("backend", HOST)
def test_a_head_over_its_tolerance_reads_the_evicted_blocks_carrying_its_bound(summary,
                                                                                backend):
    """With a bound tolerance and ``ladder.tol_page_in``, the blocks (evicted ones among them)
    whose shares carry a head's bound are read back before the widest sets, planned from the
    Phase-1 masses in the first pass and from the Phase-2 masses in a second: every head
    within the tolerance or dense (and the contract), with fewer heads escalated than without
    it (1,024 tokens, most blocks evicted, broad queries); on fewer FP16 keys where the
    summary bounds logits closely, and with the box (whose loose Phase-1 masses plan more)
    on more keys but with fewer heads dense."""
    policy = StreamingEviction(budget=0.5 if summary == "keys4" else 0.3, sink=16,
                               summary=summary)
    store = TieredKVStore(2, D, block_size=16,
                          quantizer=KVQuantizer(block_size=16).with_eviction(policy))
    k, v = make_kv(2, 1024, D, seed=4, outlier_channels=2)
    store.append(k, v)
    assert store.evicted_mask().any()
    read, escalated, dense = {}, {}, {}
    for on in (False, True):
        attn = CertifiedAttention(backend=backend(),
                                  ladder=Ladder(bound_tol=0.05, tol_page_in=on))
        read[on] = escalated[on] = dense[on] = 0
        for seed in range(4):
            q = make_query(k, 2, seed=seed)
            out, cert = attn(q, store)
            check_heads(out, cert, q, store)
            fast = cert.rung < 3
            assert (cert.bound[fast] <= 0.05).all()
            read[on] += int(cert.k_star.sum())
            escalated[on] += int((cert.tol_level > 0).sum())
            dense[on] += int((~fast).sum())
    assert escalated[True] < escalated[False]
    if summary == "box":
        assert dense[True] < dense[False]
    else:
        assert read[True] < read[False] and dense[True] <= dense[False]


def test_a_bad_page_in_budget_is_one_sentence():
    for bad in (-1, 1.5, True):
        with pytest.raises(ConfigError, match="page_in_budget"):
            Ladder(page_in_budget=bad)
    with pytest.raises(ConfigError, match=r"evict\.summary='boxes' is unknown"):
        StreamingEviction(summary="boxes")
