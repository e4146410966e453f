"""A certified step captured once replays as an eager step would (issue 24's CUDA graphs).

On a CPU the capture is :class:`~certkv.graphs.RecordedGraph`: the step's aten operators and
Triton launches (the interpreter here) re-run on the captured tensors with every Python value
as captured, which is what a CUDA graph replays. Each replay below follows appends that change
everything a step reads (the tail block's fill, the value norms and key maxima, the scratch
cache's tables) and must equal the eager step bitwise, certificate included."""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, make_kv, make_query, same_values, store_contents

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.errors import ConfigError, NonFiniteError, ShapeError
from certkv.graphs import GraphCaptureError, GraphedAttention, RecordedGraph

B, D = 8, 32


def setup(n=100, hkv=2, group=2, seed=0, scratch: int | None = 4):
    """Two identical stores (eager and graphed) and their scratch caches (``scratch`` blocks
    of keys and of values, or None), with ``n`` tokens."""
    k, v = make_kv(hkv, n, D, seed=seed, outlier_channels=2)
    stores = [TieredKVStore(hkv, D, block_size=B) for _ in range(2)]
    for store in stores:
        store.append(k, v)
    caches = [None if scratch is None else ScratchCache(scratch, scratch) for _ in range(2)]
    return stores, caches, make_query(k, group, seed=seed, peaked=True)


def grown(q, step, hkv=2):
    """The ``step``-th appended token (larger norms every step: the store's maxima change)
    and the next query."""
    gen = torch.Generator().manual_seed(100 + step)
    k = torch.randn(hkv, 1, D, generator=gen) * (1 + step)
    v = torch.randn(hkv, 1, D, generator=gen) * (1 + step)
    return k.half(), v.half(), None if q is None else q + 0.1 * torch.randn(q.shape,
                                                                           generator=gen)


def assert_same(a, b):
    """Outputs and every certificate field (block statistics included) bit for bit."""
    (out_a, cert_a), (out_b, cert_b) = a, b
    assert torch.equal(out_a, out_b)
    assert same_values(cert_a, cert_b)


@pytest.mark.parametrize("scratch", [4, None])
def test_replays_equal_eager_steps_through_block_completions(scratch):
    """A small scratch cache (blocks evicted and re-read as the steps' wants change; 4 slots
    caught the stale-table bug of 8571892 as 64 did) and none, each step's query peaked on
    other keys (the blocks it wants change). A graphed
    attention pads its layouts to the store's block capacity and captures one step per bucket
    (a length of the store's buffers), whose replays run on through block completions: every
    step equals the eager step over the same padded layout bit for bit, certificate and its
    quantized block count included. The device LRU's own tables are compared too, so that state
    a replay would restore stale (e.g. tables resized inside a capture) shows."""
    (eager_store, graph_store), (eager_cache, graph_cache), _ = setup(n=6 * B + 13,
                                                                      scratch=scratch)
    keys = eager_store.dense_kv()[0].float()
    eager = CertifiedAttention(backend="triton", compile=False)
    eager.pad_layout = True
    graphed = GraphedAttention(CertifiedAttention(backend="triton", compile=False),
                               graph=RecordedGraph)
    buckets: dict = {}  # graph signature -> block counts replayed under it
    for step in range(B + 5):  # blocks 6 -> 8 (at steps 2 and B + 2): inside and across buckets
        k, v, _ = grown(None, step)
        q = make_query(keys, 2, seed=step, peaked=True)
        for store in (eager_store, graph_store):
            store.append(k, v)
        assert_same(eager(q, eager_store, scratch=eager_cache),
                    graphed(q, graph_store, scratch=graph_cache))
        if scratch:  # the device LRU's state itself, not only what it served this step
            for which in "kv":
                tables = [c.device_lru(which).tables(s) for c, s in
                          ((eager_cache, eager_store), (graph_cache, graph_store))]
                assert all(torch.equal(a, b) for a, b in zip(*tables, strict=True)), step
        buckets.setdefault(graph_store.graph_signature(), set()).add(graph_store.num_blocks)
    assert graphed.captures == len(buckets) >= 2  # one per bucket, not per block count
    assert max(len(blocks) for blocks in buckets.values()) >= 2  # replayed through completions
    assert graphed.replays == B + 5 - 2 * len(buckets)
    if scratch:
        assert eager_cache.stats == graph_cache.stats


@pytest.mark.parametrize("scratch", [4])  # without one: the replay test's padded steps
def test_steps_over_a_padded_layout_are_the_unpadded_steps(scratch):
    """Issue 24's bucketed block counts, the step itself: over a layout padded to the store's
    block capacity (empty blocks after the tail block's column) every decode step through
    block completions and a growth of the buffers returns the unpadded step's output, rungs,
    key and value sets and key/value errors; ``e_arith`` counts the padded token slots (a
    little larger, never smaller), and the contract holds on every head."""
    (plain_store, padded_store), (plain_cache, padded_cache), _ = setup(n=6 * B + 13,
                                                                        scratch=scratch)
    keys = plain_store.dense_kv()[0].float()
    plain = CertifiedAttention(backend="triton", compile=False)
    padded = CertifiedAttention(backend="triton", compile=False)
    padded.pad_layout = True
    widths = set()
    for step in range(B + 5):  # blocks 6 -> 8 (at steps 2 and B + 2): the capacity grows 8 -> 16
        k, v, _ = grown(None, step)
        q = make_query(keys, 2, seed=step, peaked=True)
        for store in (plain_store, padded_store):
            store.append(k, v)
        out_a, cert_a = plain(q, plain_store, scratch=plain_cache)
        out_b, cert_b = padded(q, padded_store, scratch=padded_cache)
        widths.add(padded._layout(padded_store, True).num_blocks)
        torch.testing.assert_close(out_b, out_a, rtol=1e-6, atol=1e-7)
        for name in ("rung", "k_star", "value_blocks", "ranking_ok", "boundary_ok",
                     "canary_ok"):
            assert torch.equal(getattr(cert_a, name), getattr(cert_b, name)), (step, name)
        for name in ("e_key", "e_val", "tail_mass"):
            torch.testing.assert_close(getattr(cert_b, name), getattr(cert_a, name),
                                       rtol=1e-5, atol=1e-30)
        assert (cert_b.e_arith >= cert_a.e_arith).all()
        assert (cert_b.e_arith <= 1.5 * cert_a.e_arith).all()
        check_heads(out_b, cert_b, q, padded_store)
    assert widths == {8, 16}
    if scratch:
        assert plain_cache.stats == padded_cache.stats


def test_a_replay_copies_its_results_out_once_per_dtype():
    """The captured step packs its output and certificate into one buffer per dtype, so a
    replay copies them out of the graph in a copy per dtype (not one per tensor, about 25
    launches on a GPU); what it returned stays as it was when the graph replays again."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Copies(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.__name__.split(".")[0] in ("clone", "copy_")
            return func(*args, **(kwargs or {}))

    (_, store), (_, cache), q = setup(n=5 * B + 3)
    graphed = GraphedAttention(CertifiedAttention(backend="triton", compile=False),
                               graph=RecordedGraph)
    for _ in range(2):  # an eager step, then the capture
        graphed(q, store, scratch=cache)
    out, cert = graphed(q, store, scratch=cache)  # a replay
    packed = next(iter(graphed._steps.values())).outputs
    with Copies() as copies:  # what a replay does after the graph's own launch
        copied = packed.copied()
    assert copies.count == len(packed.buffers) <= 4  # float32, int64, bool (and q's dtype)
    assert torch.equal(copied[0], out) and same_values(copied[1][0], cert)
    kept = cert.copy(), out.clone()
    k, v, q = grown(q, 0)
    store.append(k, v)
    again = graphed(q, store, scratch=cache)
    assert graphed.replays == 2 and not torch.equal(again[0], out)
    assert same_values(cert, kept[0]) and torch.equal(out, kept[1])


def test_a_layout_changes_only_when_a_block_completes():
    """The device path keeps the tail block's column while the tail is empty, so one capture
    serves a block's ``B`` steps (the tail holding 0 to ``B - 1`` tokens)."""
    (_, store), _, q = setup(n=6 * B)  # the tail empty
    attn = CertifiedAttention(backend="triton", compile=False)
    layouts = []
    for step in range(B + 1):
        layouts.append(attn.graph_layout(store))
        k, v, q = grown(q, step)
        store.append(k, v)
    assert len(set(layouts[:B])) == 1 and layouts[B] != layouts[0]


def test_a_replayed_step_with_nonfinite_values_is_invalid_and_raises_at_synchronize():
    (_, store), (_, cache), q = setup(n=5 * B + 1)  # no block completes in the next 4 steps
    attn = CertifiedAttention(backend="triton", compile=False)
    graphed = GraphedAttention(attn, graph=RecordedGraph)
    for step in range(3):
        k, v, q = grown(q, step)
        store.append(k, v)
        graphed(q, store, scratch=cache)
        attn.synchronize()
    assert graphed.replays == 1
    k, v, q = grown(q, 3)
    store.append(k, v)
    _, cert = graphed(q.masked_fill(torch.arange(q.shape[0])[:, None] == 0, float("nan")),
                      store, scratch=cache)
    assert graphed.replays == 2 and torch.isinf(cert.bound).all()
    with pytest.raises(NonFiniteError, match="NaN or Inf"):
        attn.synchronize()


def test_a_step_that_reads_the_host_cannot_be_captured():
    (_, store), (_, cache), q = setup()
    host = CertifiedAttention(backend="torch", compile=False)  # reads the flags on the host
    with pytest.raises(GraphCaptureError, match="host read"):
        RecordedGraph().capture(lambda: host(q, store, scratch=cache))


def test_graphs_on_a_cpu_name_the_fix():
    (_, store), (_, cache), q = setup()
    graphed = GraphedAttention(CertifiedAttention(backend="triton", compile=False))
    for _ in range(2):
        k, v, q = grown(q, 0)
        store.append(k, v)
        with pytest.raises(ConfigError, match="graphs=false"):
            graphed(q, store, scratch=cache)


def test_a_model_decodes_the_same_with_its_steps_replayed():
    """generate() with every layer's step captured and replayed (prompt of 60 tokens, B = 16,
    8 decode steps: the layout changes once, at the first step with an empty tail block, so
    per layer two eager steps, two captures and four replays) gives the eager run's tokens,
    step log and scratch counters."""
    from helpers.models import tiny_model

    from certkv.models import cache_kwargs
    from certkv.models.hf_cache import CacheSpec, TieredCache

    _, model = tiny_model()
    ids = torch.randint(0, 512, (1, 60), generator=torch.Generator().manual_seed(0))
    runs, graphed = [], None
    for graph in (None, RecordedGraph):
        attn = CertifiedAttention(backend="triton", compile=False)
        attn.pad_layout = True  # as the graphed attention pads its layouts
        if graph is not None:
            attn = graphed = GraphedAttention(attn, graph=graph)
        cache = TieredCache(2, attn, spec=CacheSpec(scratch_key_blocks=4, scratch_value_blocks=4))
        out = model.generate(ids, max_new_tokens=9, do_sample=False, **cache_kwargs(model, cache))
        cache.log.flush()
        runs.append((out, cache.log.steps, cache.scratch_stats()))
    (out_e, steps_e, stats_e), (out_g, steps_g, stats_g) = runs
    assert torch.equal(out_e, out_g) and stats_e == stats_g
    assert steps_e == steps_g
    assert graphed.captures == 2 * 2 and graphed.replays == 2 * 4


def store_state(store):
    """Everything the store holds (:func:`helpers.store_contents`) and the whole tail buffers,
    rows past the tail's tokens included (an in-place append writes where a plain one does)."""
    return [*store_contents(store), *store.tail_buffers()]


def test_an_append_captured_once_writes_each_replayed_token_where_it_belongs():
    """The in-place append (what a captured decode step runs) reads the tail's fill and the
    completed-block count from device memory: replayed with each new token copied into its
    inputs, through a block completion (an eager append in between), it leaves the store
    (tail, counts, maxima, decoded mirror) as plain appends do, bit for bit. Non-finite K/V
    is flagged for the attention step, not raised; a token that completes a block is refused
    with the fix named."""
    stores = [TieredKVStore(2, D, block_size=B, decoded_mirror=True) for _ in range(2)]
    k, v = make_kv(2, 4 * B + 5, D, seed=4)
    for store in stores:
        store.append(k, v)
    plain, captured = stores
    signature = captured.graph_signature()  # buffers of 8 blocks: no growth below
    token = [torch.zeros(2, 1, D, dtype=torch.float16) for _ in range(2)]  # graph inputs
    graph = RecordedGraph()
    graph.capture(lambda: captured.append_in_place(*token))
    plain.append(*token)
    for step in range(2 * B):
        k, v, _ = grown(None, step)
        plain.append(k, v)
        if captured.tail_len + 1 == B:  # completes a block: the eager path
            captured.append(k, v)
        else:
            token[0].copy_(k)
            token[1].copy_(v)
            graph.replay()
            captured.advance_tail()
        assert captured.tail_len == plain.tail_len
        assert all(torch.equal(a, b) for a, b in zip(store_state(plain),
                                                     store_state(captured), strict=True)), step
    assert captured.num_blocks == 6 and captured.graph_signature() == signature
    token[0].fill_(float("nan"))
    graph.replay()  # no raise: the flag the attention step reads
    assert bool(captured.nonfinite_appended())
    captured.advance_tail()
    while captured.tail_len + 1 < B:
        captured.append(k, v)
    with pytest.raises(ShapeError, match="use append"):
        captured.append_in_place(k, v)


def test_with_deferred_commits_a_captured_append_replays_every_token():
    """``defer_commit`` (what GraphedDecode sets): the in-place append takes the token that
    fills the tail too, so one capture serves every token; the full block is committed between
    replays (``flush_tail``). Through two completions the store holds what plain appends of a
    deferring store leave, bit for bit (codes, annotations, Tier-2, tail, counts, maxima,
    mirror), and its buffers never grow (one bucket)."""
    stores = [TieredKVStore(2, D, block_size=B, decoded_mirror=True) for _ in range(2)]
    k, v = make_kv(2, 4 * B + 5, D, seed=5)
    for store in stores:
        store.defer_commit = True
        store.append(k, v)
    plain, captured = stores
    signature = captured.graph_signature()  # buffers of 8 blocks: no growth below
    token = [torch.zeros(2, 1, D, dtype=torch.float16) for _ in range(2)]
    graph = RecordedGraph()
    graph.capture(lambda: captured.append_in_place(*token))
    plain.append(*token)
    for step in range(2 * B + 2):
        k, v, _ = grown(None, step)
        plain.append(k, v)
        captured.flush_tail()
        token[0].copy_(k)
        token[1].copy_(v)
        graph.replay()
        captured.advance_tail()
        assert all(torch.equal(a, b) for a, b in zip(store_contents(plain),
                                                     store_contents(captured), strict=True)), step
    assert captured.num_blocks == 6 and captured.graph_signature() == signature


@pytest.mark.slow
def test_a_model_decodes_the_same_with_its_whole_steps_replayed():
    """A model's whole decode step captured once per bucket (GraphedDecode: every layer's
    projections, the token's in-place append, the certified attention, the MLP and the logits)
    and replayed gives the eager steps' logits bit for bit, and their step log and scratch
    counters, the eager run's stores deferring their commits as GraphedDecode's do. Prompt of
    12 tokens, B = 4, 13 steps: a bucket of 4 blocks, then one of 8 replayed through two block
    completions (a block list made before its buffer grew would end early there); only each
    bucket's first two steps run eagerly, those whose token fills a block replay."""
    from helpers.models import greedy_decode, tiny_model

    from certkv.graphs import GraphedDecode
    from certkv.models.hf_cache import CacheSpec, TieredCache
    from certkv.quant import KVQuantizer

    _, model = tiny_model()
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    runs = []
    for graphed in (False, True):
        attn = CertifiedAttention(backend="triton", compile=False)
        attn.pad_layout = True  # as the graphed decode pads the layouts
        if graphed:
            attn = GraphedAttention(attn, graph=RecordedGraph)  # unwrapped by GraphedDecode
        cache = TieredCache(2, attn, KVQuantizer(block_size=4),
                            CacheSpec(scratch_key_blocks=4, scratch_value_blocks=4))
        cache.defer_commit = True  # as GraphedDecode sets it
        decode = GraphedDecode(model, cache, RecordedGraph) if graphed else None
        logits = greedy_decode(model, cache, ids, 13, decode)
        runs.append((logits, cache.log.steps, cache.scratch_stats(),
                     store_state(cache.layers[1].store)))
    (logits_e, steps_e, stats_e, state_e), (logits_g, steps_g, stats_g, state_g) = runs
    assert torch.equal(logits_e, logits_g)
    assert steps_e == steps_g and stats_e == stats_g
    assert all(torch.equal(a, b) for a, b in zip(state_e, state_g, strict=True))
    store = cache.layers[1].store
    assert (store.num_blocks, store.tail_len) == (5, 4)  # the sixth block full, kept as the tail
    assert (decode.captures, decode.replays, decode.steps) == (2, 13 - 2 * 2, 13)


def test_stores_whose_layout_changes_at_any_step_are_not_graphed():
    """SmartKV's adaptive widths and eviction change which blocks a step reads between block
    completions: their steps run eagerly (no graph signature)."""
    from certkv.evict import HeavyHitterEviction
    from certkv.quant import KVQuantizer, SmartKVQuantizer

    k, v = make_kv(2, 40, D, seed=0)
    for quantizer in (SmartKVQuantizer(block_size=B),
                      KVQuantizer().with_eviction(HeavyHitterEviction(budget=0.6, recent=16))):
        store = TieredKVStore(2, D, quantizer=quantizer)
        store.append(k, v)
        assert store.graph_signature() is None
    plain = TieredKVStore(2, D)
    plain.append(k, v)
    signature, more = plain.graph_signature(), make_kv(2, 24, D, seed=1)
    assert signature is not None
    plain.append(more[0][:, :8], more[1][:, :8])  # block 3 completes in the buffers' room
    assert plain.num_blocks == 3 and plain.graph_signature() == signature
    plain.append(more[0][:, 8:], more[1][:, 8:])  # block 4: the buffers grow
    assert plain.graph_signature() != signature


@pytest.mark.slow
def test_a_batch_decodes_the_same_with_its_whole_steps_replayed():
    """A batch's whole decode step (three sequences of 9, 12 and 5 prompt tokens, each at its
    own positions, one store per sequence and layer) captured once per bucket and replayed
    gives the eager batched steps' logits bit for bit, and every sequence's step log, through
    block completions; a sequence's growing buffers or its leaving make a new bucket, and the
    sequences that go on decode as before."""
    from helpers.models import decode_a_batch, tiny_model

    _, model = tiny_model()
    eager = decode_a_batch(model, CertifiedAttention(backend="triton", compile=False))
    graphed = decode_a_batch(model, CertifiedAttention(backend="triton", compile=False),
                             graphed=True, graph=RecordedGraph)
    assert all(torch.equal(a, b) for a, b in zip(eager.logits, graphed.logits, strict=True))
    assert eager.logs == graphed.logs and [len(s) for s in graphed.logs] == [10, 6, 10]
    assert eager.length == graphed.length == 12 + 10  # the widest prompt and its steps
    # buckets (each: an eager step, a capture, then replays): steps 0-3 (replays at 2 and 3,
    # the first sequence's block filled at 2 and quantized before 3), 4-5 (the second
    # sequence's buffers grew), 6 (it left), 7-9 (the first's buffers grew; a replay at 9)
    decode = graphed.decode
    assert (decode.captures, decode.replays, decode.steps) == (3, 3, 10)
