"""torch.compile of the selection and certificate segments (on by default on CUDA): one graph
each, dynamic shapes, results identical to eager, and an eager fallback if compiling fails.
On CPU the graphs are checked with the ``aot_eager`` backend (fast, no C++ toolchain)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.certify import Ladder


def test_compiled_segments_match_eager_across_growing_contexts():
    """The selection and certificate segments compile to one graph each (no graph breaks,
    dynamic shapes) and return exactly what the eager code returns."""
    k, v = make_kv(2, 190, 32, seed=0, outlier_channels=2)
    store = TieredKVStore(2, 32, value_group=8)
    store.append(k[:, :100], v[:, :100])
    eager = CertifiedAttention(ladder=Ladder(exploration=0.1))
    compiled = CertifiedAttention(ladder=Ladder(exploration=0.1), compile="aot_eager")
    for step, end in enumerate([100, 117, 141, 190]):
        store.append(k[:, store.num_tokens:end], v[:, store.num_tokens:end]) \
            if end > store.num_tokens else None
        q = make_query(k[:, :end], 3, seed=step, scale=3.0, peaked=True)
        (a, ca), (b, cb) = eager(q, store), compiled(q, store)
        assert torch.equal(a, b) and torch.equal(ca.rung, cb.rung)
        assert torch.equal(ca.k_star, cb.k_star) and torch.equal(ca.bound, cb.bound)
    assert {key[1] for key in compiled._compiled} == {"aot_eager"}
    assert all(seg.compiled is not None for seg in compiled._compiled.values())


def test_a_segment_that_cannot_compile_runs_eagerly_with_one_warning():
    k, v = make_kv(2, 64, 32, seed=1)
    store = TieredKVStore(2, 32)
    store.append(k, v)
    q = make_query(k, 2, seed=1)
    with pytest.warns(RuntimeWarning, match="running it eagerly"):
        out, _ = CertifiedAttention(compile="no_such_backend")(q, store)
    expected, _ = CertifiedAttention()(q, store)
    assert torch.equal(out, expected)


def test_a_growing_cache_under_inference_mode_compiles_each_segment_once():
    """On SmolLM2 (GPU, 4K RULER) the segments recompiled until dynamo's limit of 8 and then
    ran eagerly: views of growing buffers change stride with their capacity, and tensors made
    before the first step are not inference tensors. Both now keep the first graph, also where
    an earlier step outside inference mode memoised the arithmetic coefficients of a count."""
    from torch._dynamo.utils import counters

    k, v = make_kv(2, 700, 32, seed=2, outlier_channels=2)
    earlier = TieredKVStore(2, 32, value_group=8)
    earlier.append(k[:, :300], v[:, :300])
    CertifiedAttention(compile="eager")(make_query(k[:, :300], 3, seed=0, scale=3.0), earlier)
    store = TieredKVStore(2, 32, value_group=8)
    store.append(k[:, :70], v[:, :70])  # made outside inference mode, like a prefill
    attention = CertifiedAttention(compile="eager")
    graphs = []
    with torch.inference_mode():  # (n = 5 blocks at first: no size equals the group's, 3,
        # which dynamo's duck sizing would tie to it and recompile for when n grows)
        for step, end in enumerate([71, 72, 97, 160, 161, 300, 555, 700]):
            store.append(k[:, store.num_tokens:end], v[:, store.num_tokens:end])
            attention(make_query(k[:, :end], 3, seed=step, scale=3.0), store)
            graphs.append(counters["stats"]["unique_graphs"])
    assert all(seg.compiled is not None for seg in attention._compiled.values())
    assert graphs == [graphs[0]] * len(graphs), graphs
