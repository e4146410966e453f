"""Rungs 3-4 on a CPU store through the numba loops over the FP16 originals in place
(:mod:`certkv.kernels.numba_dense`): within the dense path's own ``e_arith`` of FP64 attention on
the test's copy of the data, for every head, whatever the context, query and keys."""

from __future__ import annotations

import pytest
import torch

from certkv import AdaptiveTopK, CertifiedAttention, ChannelAffineKeyCodec, Ladder, TieredKVStore
from certkv.kernels import numba_dense

pytest.importorskip("numba")

HKV, GROUP, D = 3, 2, 32


def _data(tokens: int, case: str, seed: int = 0):
    """``(k, v [Hkv, N, d] FP32, q [Hq, d])`` of one adversarial ``case``."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(HKV, tokens, D, generator=gen)
    v = torch.randn(HKV, tokens, D, generator=gen)
    q = torch.randn(HKV * GROUP, D, generator=gen)
    if case == "outliers":  # a few channels far larger than the rest, keys and values
        k[..., :2] *= 300.0
        v[..., -1] *= 1000.0
    elif case == "near_ties":  # huge logits a rounding apart: every key nearly the same
        k = 60.0 + 1e-3 * k
        q = q.abs() * 4.0
    elif case == "huge_query":  # logits far beyond FP32 unless the query is prescaled
        q = q * 1e30
    return k, v, q


def _fp64(q, k16, v16, scaling):
    """FP64 attention ``[Hq, d]`` on the test's own FP16 copies (GQA: query head ``h`` on kv
    head ``h // GROUP``)."""
    kk = k16.double().repeat_interleave(GROUP, dim=0)
    vv = v16.double().repeat_interleave(GROUP, dim=0)
    logits = torch.einsum("hd,hnd->hn", q.double(), kk) * scaling
    return torch.einsum("hn,hnd->hd", torch.softmax(logits, dim=-1), vv)


@pytest.mark.parametrize("tokens", [7, 16 * 16, 16 * 40 + 5])
@pytest.mark.parametrize("case", ["random", "outliers", "near_ties", "huge_query"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_dense_path_is_within_its_bound_of_fp64_attention(tokens, case, dtype):
    """mode=dense on a CPU store (the numba loops): every head within its reported
    ``e_arith`` of FP64 attention on the test's copy of the FP16 originals, no allowance: a
    store of only a tail block, whole blocks, and several chunks of 256 tokens with a tail."""
    k, v, q = _data(tokens, case)
    if dtype == torch.float16 and case == "huge_query":
        q = q / q.abs().amax() * 6e4  # near FP16's largest: still prescaled
    q = q.to(dtype)
    store = TieredKVStore(HKV, D, decoded_mirror="lean")
    store.append(k, v)
    out, cert = CertifiedAttention(mode="dense")(q, store)
    assert (cert.rung == 4).all()
    oracle = _fp64(q, k.half(), v.half(), D**-0.5)
    err = (out.double() - oracle).norm(dim=-1)
    assert torch.isfinite(out).all()
    assert (err <= cert.e_arith.double()).all(), (err, cert.e_arith)


def test_a_subset_of_heads_gets_the_rows_of_the_whole_layer():
    """Rung 3 (some heads, any order, kv heads mixed) gives each head exactly the row rung 4
    gives it: the rows do not depend on which other heads are read."""
    k, v, q = _data(16 * 20 + 3, "outliers", seed=4)
    store = TieredKVStore(HKV, D)
    store.append(k, v)
    kv_of = torch.arange(HKV * GROUP) // GROUP
    whole = numba_dense.dense_rows(q, kv_of, store, D**-0.5)
    heads = torch.tensor([5, 0, 3])
    some = numba_dense.dense_rows(q[heads], kv_of[heads], store, D**-0.5)
    torch.testing.assert_close(some, whole[heads], rtol=0, atol=0)


def test_heads_sent_to_rung3_read_the_originals_in_place_and_keep_the_contract():
    """A certified step whose ranking check fails on some heads: those heads take the numba
    rows (the backend's ``dense_rows``), the rest stay quantized, every head within its bound
    of FP64 attention on the test's copy."""
    attn = CertifiedAttention(selector=AdaptiveTopK(tau_cov=1.0, k_min=0, k_max=128),
                              ladder=Ladder(r=3, layer_dense_fraction=1.0))
    calls = []
    real = attn.backend.dense_rows
    attn.backend.dense_rows = lambda *a: calls.append(a[1].tolist()) or real(*a)
    for seed in range(40):  # the first data whose checks fail on some heads but not all
        k, v, q = _data(16 * 24, "random", seed=seed)
        store = TieredKVStore(HKV, D, key_codec=ChannelAffineKeyCodec(bits=2))
        store.append(k, v)
        calls.clear()
        out, cert = attn(q * (1 + seed % 4), store)
        dense = (cert.rung >= 3).nonzero().flatten().tolist()
        if dense and len(dense) < q.shape[0]:
            break
    assert dense and len(dense) < q.shape[0]
    assert calls == [dense]
    q = q * (1 + seed % 4)
    err = (out.double() - _fp64(q, k.half(), v.half(), D**-0.5)).norm(dim=-1)
    assert (err <= cert.bound.double()).all()


def test_fp64_queries_keep_the_reference_chain():
    """An FP64 query is not the numba loops' to take (its chain is the reference's FP64 one)."""
    store = TieredKVStore(HKV, D)
    store.append(*_data(40, "random")[:2])
    assert numba_dense.covers(store, torch.zeros(2, D))
    assert not numba_dense.covers(store, torch.zeros(2, D, dtype=torch.float64))
