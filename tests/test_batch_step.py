"""The batched device step (:mod:`certkv.batch_step`, issue 54): a batch's certified step on the
Triton kernels (here their interpreter) is one launch per stage over every sequence, and gives
each sequence the output and certificate its own step gives, bit for bit, within the contract
(FP64 attention on the test's own copy of that sequence's originals, no allowance)."""

from __future__ import annotations

import pytest
import torch
from helpers import check_heads, make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.ladder import Ladder
from certkv.opcount import count_step
from certkv.quant import (
    GroupAffineValueCodec,
    InnerQKeyCodec,
    InnerQValueCodec,
    KiviKeyCodec,
    KVQuantizer,
    SmartKVQuantizer,
)
from certkv.quant.protect import FaultModel, Protection

HKV, D = 2, 64
DEVICE_STEP = {"host_reads": 0, "kernels": 6, "segments": 0, "eager_launches": 0}
QUANTIZERS = {
    "int8_int4": KVQuantizer,
    "kivi2_window": lambda: KVQuantizer(KiviKeyCodec(bits=2),
                                        GroupAffineValueCodec(bits=2, group=32),
                                        block_size=16, residual=64),
    "smartkv": lambda: SmartKVQuantizer(block_size=16, recency=64),
    "innerq_window": lambda: KVQuantizer(InnerQKeyCodec(bits=2), InnerQValueCodec(bits=2),
                                         block_size=16, residual=64),
    "hamming84": lambda: KVQuantizer().with_protection(
        Protection("hamming84", "zero", True, FaultModel())),
}


@pytest.fixture
def batched(monkeypatch):
    """How many batch steps ran as one batched device step."""
    calls = []
    real = CertifiedAttention._device_batch

    def spy(self, *args, **kwargs):
        calls.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CertifiedAttention, "_device_batch", spy)
    return calls


def twin_batches(quantizer, lengths, seed=0):
    """Two identical sets of stores with their prompts and scratch caches: one for the batch,
    one for the sequences alone."""
    twins = []
    for _ in range(2):
        stores = []
        for b, n in enumerate(lengths):
            store = TieredKVStore(HKV, D, **quantizer().store_kwargs())
            store.append(*make_kv(HKV, n, D, seed=seed + b, outlier_channels=2))
            stores.append(store)
        twins.append((stores, [ScratchCache(6, 6) for _ in lengths]))
    return twins


def queries(lengths, step, group=3, scale=1.0, seed=0):
    return torch.stack([make_query(make_kv(HKV, n, D, seed=seed + b)[0], group,
                                   seed=seed + 31 * b + step, scale=scale, peaked=b % 2 == 0)
                        for b, n in enumerate(lengths)])


def assert_alone_equal(out, certs, q, alone, attn_alone, live):
    """Each sequence's output and certificate equal its own step's, and keep the contract."""
    for i, b in enumerate(live):
        stores, scratches = alone
        own, cert = attn_alone(q[i], stores[b], scratch=scratches[b])
        assert torch.equal(out[i], own), b
        for name in ("bound", "e_key", "e_val", "e_arith", "rung", "k_star", "value_blocks"):
            assert torch.equal(getattr(certs[i], name), getattr(cert, name)), (name, b)
        assert certs[i].sequence == i
        check_heads(out[i], certs[i], q[i], stores[b])


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_every_sequence_gets_its_own_step_bit_for_bit_within_the_contract(name, batched):
    """Ragged sequences (a few hundred tokens, 37, 5: no completed block, 160) of one
    quantizer, three steps with appends across block boundaries, one sequence finishing after
    the first: each step is one batched device step, and every sequence's output and
    certificate are those of its own step."""
    lengths = [300, 37, 5, 160]
    (stores, scratches), alone = twin_batches(QUANTIZERS[name], lengths)
    attn = CertifiedAttention(backend="triton", compile=False)
    attn_alone = CertifiedAttention(backend="triton", compile=False)
    live = list(range(len(lengths)))
    for step in range(3):
        if step == 2:
            live.remove(1)  # it finished: the batch goes on without it
        q = queries([lengths[b] for b in live], step)
        out, certs = attn.batch(q, [stores[b] for b in live],
                                scratches=[scratches[b] for b in live])
        assert_alone_equal(out, certs, q, alone, attn_alone, live)
        for b in live:
            extra = make_kv(HKV, 9, D, seed=97 * b + step)
            stores[b].append(*extra)
            alone[0][b].append(*extra)
    assert len(batched) == 3


@pytest.mark.parametrize("size", [2, 5])
def test_a_batch_of_any_size_steps_in_the_launches_of_one_sequence(size, batched):
    """Steady state (scratch hits, the second step over the same stores): six Triton launches
    and nothing else, whatever the batch's size and its sequences' lengths."""
    lengths = [300, 5, 120, 64, 17][:size]
    (stores, scratches), _ = twin_batches(QUANTIZERS["kivi2_window"], lengths)
    attn = CertifiedAttention(backend="triton", compile=False)
    q = queries(lengths, 0)
    attn.batch(q, stores, scratches=scratches)
    counts = count_step(lambda: attn.batch(q, stores, scratches=scratches), attn)
    assert {k: counts[k] for k in DEVICE_STEP} == DEVICE_STEP
    assert len(batched) == 2


@pytest.mark.parametrize(("ladder", "seed"), [(Ladder(r=3), 0),
                                            (Ladder(r=3, layer_dense_fraction=0.3), 5)])
def test_a_fallback_in_one_sequence_never_makes_another_dense(ladder, seed, batched):
    """Heads on rungs 3-4 (the top-3 ranking check failing; with a low layer-dense fraction,
    whole sequences on rung 4) in some sequences and not in others: the rungs are decided per
    (sequence, head), each as its own step decides them."""
    lengths = [200, 180, 150, 220]
    (stores, scratches), alone = twin_batches(KVQuantizer, lengths, seed=seed)
    attn = CertifiedAttention(backend="triton", compile=False, ladder=ladder)
    attn_alone = CertifiedAttention(backend="triton", compile=False, ladder=ladder)
    q = queries(lengths, 0, seed=seed)
    out, certs = attn.batch(q, stores, scratches=scratches)
    dense = [bool((cert.rung >= 3).any()) for cert in certs]
    assert any(dense) and not all(dense), [cert.rung.tolist() for cert in certs]
    if ladder.layer_dense_fraction < 1:  # a whole sequence on rung 4, not another
        layer = [bool((cert.rung == 4).all()) for cert in certs]
        assert any(layer) and not all(layer)
    assert_alone_equal(out, certs, q, alone, attn_alone, range(len(lengths)))
    assert len(batched) == 1


def test_steps_the_kernels_do_not_run_step_one_sequence_at_a_time(batched):
    """A naive step, a shared scratch cache, a batch of one, or stores whose reads draw
    transient faults (each step reads them once, and a batch that fell back to its sequences
    would read them twice): each sequence alone, each as its own step decides."""
    lengths = [200, 40]
    (stores, _), _ = twin_batches(KVQuantizer, lengths)
    q = queries(lengths, 0)
    CertifiedAttention(backend="triton", mode="naive").batch(q, stores)
    shared = ScratchCache(6, 6)
    CertifiedAttention(backend="triton").batch(q, stores, scratches=[shared, shared])
    CertifiedAttention(backend="triton").batch(q[:1], stores[:1])
    assert batched == []
    faulty = lambda: KVQuantizer().with_protection(  # noqa: E731
        Protection("hamming84", "zero", True, FaultModel(p=1e-3, seed=3, transient=True)))
    (stores, _), (alone, _) = twin_batches(faulty, lengths)
    out, certs = CertifiedAttention(backend="triton").batch(q, stores)
    for i, store in enumerate(alone):
        own, cert = CertifiedAttention(backend="triton")(q[i], store)
        assert torch.equal(out[i], own) and torch.equal(certs[i].bound, cert.bound)
    assert batched == []
