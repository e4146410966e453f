"""Batches (issue 54): many sequences of different lengths decoded at once, one store each,
each with its own certificate.

The contract property test draws a batch (1-8 sequences, ragged from a few tokens to 2,500 on
both CPU backends and to 240 on the Triton kernels in their interpreter; every quantizer,
protection and eviction policy of ``conf/``) and checks every (sequence, head) of every step
against FP64 attention on that sequence's own originals (the test's copy, no allowance). The
same steps taken one sequence at a time, on twin stores, give every sequence the same output
and certificate bit for bit (on a GPU, where the batched kernels, :mod:`certkv.batch_step`,
may sum in another order, both keep the contract); a sequence that finishes leaves the batch
and the others go on unchanged.
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, examples, make_kv, make_query
from helpers.components import QUANTIZERS, D, pipeline, pipelines
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from certkv import CertifiedAttention, TieredKVStore
from certkv.errors import ConfigError, EmptyStoreError, ShapeError
from certkv.quant import KVQuantizer


@st.composite
def batches(draw, backend: str, longest: int):
    """A pipeline (:func:`helpers.components.pipelines`) and the prompt lengths of its batch,
    the longest at least 160 tokens (past every config's exact windows)."""
    sc = draw(pipelines(draw(st.sampled_from(QUANTIZERS)), backend))
    others = draw(st.lists(st.integers(3, longest), min_size=0, max_size=7))
    sc["lengths"] = [draw(st.integers(160, longest)), *others]
    sc["leaves"] = draw(st.sampled_from([None, *range(len(sc["lengths"]))]))  # finishes early
    return sc


def twin_pipelines(sc):
    """Two identical sets of stores (one per sequence) and attentions: one stepped as a batch,
    one sequence at a time."""
    runs = []
    for _ in range(2):
        built = [pipeline(sc, sc["lengths"]) for _ in sc["lengths"]]
        runs.append(([store for store, _ in built], built[0][1]))
    return runs


def queries(sc, prompts, step):
    return torch.stack([
        make_query(k, sc["gqa"], seed=sc["seed"] + 31 * b + step, scale=sc["q_scale"],
                   peaked=sc["peaked"]).to(getattr(torch, sc["q_dtype"]))
        for b, (k, _) in enumerate(prompts)])


def run_batch(sc) -> None:
    (stores, attn), (alone, attn_alone) = twin_pipelines(sc)
    dev = sc.get("device", "cpu")
    prompts = [make_kv(sc["hkv"], n, D, seed=sc["seed"] + b, outlier_channels=sc["outliers"],
                       heavy_tail=sc["heavy_tail"], key_offset=sc["key_offset"])
               for b, n in enumerate(sc["lengths"])]
    for b, (store, twin, (k, v)) in enumerate(zip(stores, alone, prompts, strict=True)):
        window = k[:, -8:].repeat_interleave(sc["gqa"], dim=0)  # queries near the prompt's end
        noise = torch.randn(window.shape, generator=torch.Generator().manual_seed(b))
        window = window + 0.5 * noise
        for s in (store, twin):
            s.append(k.to(dev), v.to(dev))
            s.observe_prompt(window.to(dev))  # what SnapKV ranks by
    live = list(range(len(stores)))
    for step in range(sc["steps"] + 1):
        if step:
            for b in live:
                extra = [t.to(dev) for t in make_kv(sc["hkv"], sc["per_step"], D,
                                                    seed=sc["seed"] + 97 * b + step)]
                stores[b].append(*extra)
                alone[b].append(*extra)
        if step == 1 and sc["leaves"] is not None and len(live) > 1:
            live.remove(sc["leaves"])  # it finished: the batch goes on without it
        q = queries(sc, [prompts[b] for b in live], step)
        out, certs = attn.batch(q, [stores[b] for b in live])
        assert out.shape == q.shape and [c.sequence for c in certs] == list(range(len(live)))
        for i, b in enumerate(live):
            check_heads(out[i], certs[i], q[i], stores[b])
            own, cert = attn_alone(q[i], alone[b])
            if dev != "cpu":  # a GPU's batched kernels may sum in another order: the contract
                check_heads(own, cert, q[i], alone[b])
            else:
                assert torch.equal(out[i], own), (b, step)
                for name in ("bound", "rung", "k_star", "value_blocks"):
                    assert torch.equal(getattr(certs[i], name), getattr(cert, name)), (name, b)
            stores[b].observe(certs[i])
            alone[b].observe(cert)
    assert any(s.num_quantized() for s in stores), "no quantized block: nothing was certified"


@pytest.mark.parametrize("backend", ["torch", "numba"])
def test_every_sequence_of_a_batch_keeps_the_contract_and_its_own_result(backend):
    @settings(max_examples=examples(5), suppress_health_check=[HealthCheck.too_slow],
              deadline=None)
    @given(sc=batches(backend, longest=2500))
    def contract(sc):
        run_batch(sc)
    contract()


def test_every_sequence_of_a_batch_keeps_the_contract_on_the_triton_kernels():
    @settings(max_examples=examples(2), suppress_health_check=[HealthCheck.too_slow],
              deadline=None)
    @given(sc=batches("triton", longest=240))
    def contract(sc):
        run_batch(sc)
    contract()


@pytest.mark.gpu
def test_every_sequence_of_a_batch_keeps_the_contract_on_cuda():
    """The batched step with the Triton kernels compiled on CUDA: stores on the device, Tier-2
    in pinned host memory, longer ragged prompts than the interpreter can afford."""
    @settings(max_examples=examples(6), suppress_health_check=[HealthCheck.too_slow],
              deadline=None)
    @given(sc=batches("triton", longest=3000))
    def contract(sc):
        run_batch({**sc, "device": "cuda"})
    contract()


def stores_of(quantizers, tokens=40, hkv=2):
    stores = []
    for b, quantizer in enumerate(quantizers):
        store = TieredKVStore(hkv, D, **quantizer.store_kwargs())
        store.append(*make_kv(hkv, tokens + 7 * b, D, seed=b))
        stores.append(store)
    return stores


def test_a_batch_of_sequences_with_different_configs_is_refused_naming_the_fix():
    stores = stores_of([KVQuantizer(block_size=16), KVQuantizer(block_size=8)])
    q = torch.randn(2, 4, D)
    with pytest.raises(ConfigError, match=r"^sequence 1's store differs .* build every store "
                                          r"from the same one\.$"):
        CertifiedAttention().batch(q, stores)


def test_a_batch_whose_queries_and_stores_disagree_is_refused_naming_the_fix():
    stores = stores_of([KVQuantizer()] * 2)
    with pytest.raises(ShapeError, match="pass one store per sequence, in q's order"):
        CertifiedAttention().batch(torch.randn(3, 4, D), stores)
    with pytest.raises(ShapeError, match=r"\[batch, num_query_heads, head_dim\]"):
        CertifiedAttention().batch(torch.randn(4, D), stores)
    with pytest.raises(ShapeError, match="one per sequence or none"):
        CertifiedAttention().batch(torch.randn(2, 4, D), stores, scratches=[None])


def test_a_batch_with_a_bad_scale_or_an_empty_store_is_refused_naming_the_fix():
    """The scale is read once for the batch and each sequence's store checked as when stepped
    alone: the same one sentence each."""
    stores = stores_of([KVQuantizer()] * 2)
    q = torch.randn(2, 4, D)
    with pytest.raises(ConfigError, match=r"scaling=-1 must be a finite positive number; pass "
                                          r"the model's softmax scale"):
        CertifiedAttention().batch(q, stores, scaling=-1)
    stores[1] = TieredKVStore(stores[0].num_kv_heads, D)
    with pytest.raises(EmptyStoreError, match="append the prompt's keys and values"):
        CertifiedAttention().batch(q, stores)
