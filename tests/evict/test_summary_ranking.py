"""``ladder.rank_summaries`` (issue 56): eq. 17 ranks a promoted block held at its Tier-1 summary
by its FP16 log-mass, read from Tier-2, instead of the summary's estimate; blocks scored from
codes are ranked as before, eq. 18 and the bound are unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, make_kv, make_query

from certkv import CertifiedAttention, Ladder, TieredKVStore
from certkv.errors import ConfigError
from certkv.evict import StreamingEviction
from certkv.kernels.numba_backend import NumbaBackend
from certkv.kernels.reference import TorchBackend
from certkv.kernels.triton_backend import TritonBackend
from certkv.quant import KVQuantizer

D = 32
BACKENDS = {"torch": TorchBackend, "numba": NumbaBackend,
            "triton": lambda: TritonBackend(split=4)}


def store_of(eviction: bool, summary: str = "box") -> tuple[TieredKVStore, torch.Tensor]:
    """256 tokens with outlier channels; with ``eviction`` all but a sink and the newest
    blocks held at their summaries."""
    quantizer = KVQuantizer(block_size=16)
    if eviction:
        quantizer = quantizer.with_eviction(StreamingEviction(budget=0.3, sink=16,
                                                              summary=summary))
    store = TieredKVStore(2, D, block_size=16, quantizer=quantizer)
    k, v = make_kv(2, 256, D, seed=4, outlier_channels=2)
    store.append(k, v)
    return store, k


def tolerant(backend: str, rank_summaries: bool) -> CertifiedAttention:
    """The tolerance the eviction runs use (most blocks read in FP16, so that eq. 18 rarely
    fails and eq. 17 decides rung 3)."""
    return CertifiedAttention(backend=BACKENDS[backend](),
                              ladder=Ladder(rank_summaries=rank_summaries, bound_tol=0.05,
                                            tol_page_in=True))


def certificates(store, k, attn: CertifiedAttention) -> list:
    """Eight peaked queries' certificates, each head held to the contract (and, under a bound
    tolerance, within it or dense)."""
    tol = attn.ladder.bound_tol
    certs = []
    for seed in range(8):
        q = make_query(k, 2, seed=seed, scale=3.0, peaked=True)
        out, cert = attn(q, store)
        check_heads(out, cert, q, store)  # the contract either way
        if tol is not None:
            assert (cert.bound[cert.rung < 3] <= tol).all()
        certs.append(cert)
    return certs


def failures(certs, field: str) -> int:
    return sum(int((~getattr(c, field)).sum()) for c in certs)


@pytest.mark.parametrize("summary", ["box", "keys2"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_paged_summaries_rank_by_their_originals(backend, summary):
    """Summaries' estimates misorder the promoted blocks (ranking failures, rung 3); ranked by
    the FP16 log-masses read for them, fewer heads fail eq. 17 and go dense, and every head
    keeps the contract and its tolerance."""
    store, k = store_of(True, summary)
    assert store.evicted_mask().any()
    as_codes = certificates(store, k, tolerant(backend, True))
    paged = certificates(store, k, tolerant(backend, False))
    assert failures(as_codes, "ranking_ok") > failures(paged, "ranking_ok")
    dense = [sum(int((c.rung >= 3).sum()) for c in certs) for certs in (as_codes, paged)]
    assert dense[1] < dense[0]


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_without_evicted_blocks_the_setting_changes_nothing(backend):
    """A store with no evicted block: every certificate field the same either way."""
    store, k = store_of(False)
    for a, b in zip(certificates(store, k, tolerant(backend, True)),
                    certificates(store, k, tolerant(backend, False)), strict=True):
        for name in ("bound", "e_key", "e_val", "rung", "ranking_ok", "boundary_ok", "k_star"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_a_bad_rank_summaries_is_one_sentence():
    with pytest.raises(ConfigError, match=r"ladder\.rank_summaries='no' must be true or false"):
        Ladder(rank_summaries="no")


def test_the_device_path_checks_after_phase_2_with_paged_summaries():
    """Without a tolerance the Triton step reads no host value and would run the checks in
    Phase 2's merge; with ``rank_summaries=false`` on an evicting store they run after it on the
    FP16 log-masses, the certificate and rungs outside the merge: the contract on every head,
    and no more ranking failures than the summaries' estimates give."""
    store, k = store_of(True)
    counts = {}
    for rank_summaries in (True, False):
        attn = CertifiedAttention(backend=BACKENDS["triton"](),
                                  ladder=Ladder(rank_summaries=rank_summaries))
        assert attn._on_device(make_query(k, 2), False)  # the device path, flags unread
        counts[rank_summaries] = failures(certificates(store, k, attn), "ranking_ok")
    assert counts[False] <= counts[True]
