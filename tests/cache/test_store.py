"""TieredKVStore: atomic block quantization, tiers, annotations, byte accounting, bad input."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import make_kv, store_contents

from certkv import ChannelAffineKeyCodec, GroupAffineValueCodec, TieredKVStore
from certkv.errors import (
    BudgetError,
    ConfigError,
    NonFiniteError,
    ShapeError,
    Tier2UnavailableError,
)
from certkv.evict import AgeEviction, SnapKVEviction
from certkv.quant import FP16KeyCodec, FP16ValueCodec, KVQuantizer


def test_streaming_append_equals_bulk_append():
    k, v = make_kv(3, 75, 32, seed=1, outlier_channels=2)
    bulk = TieredKVStore(3, 32, block_size=8, value_group=8)
    bulk.append(k, v)
    stream = TieredKVStore(3, 32, block_size=8, value_group=8)
    for t in range(75):
        stream.append(k[:, t : t + 1], v[:, t : t + 1])
    mixed = TieredKVStore(3, 32, block_size=8, value_group=8)
    for chunk in torch.tensor_split(torch.arange(75), [5, 6, 30, 31]):
        mixed.append(k[:, chunk], v[:, chunk])
    for other in (stream, mixed):
        assert other.num_tokens == bulk.num_tokens == 75
        assert other.num_blocks == 9 and other.tail_len == 3
        for a, b in ((bulk.key_blocks(), other.key_blocks()),
                     (bulk.value_blocks(), other.value_blocks())):
            assert a.keys() == b.keys()
            for name in a:
                assert torch.equal(a[name], b[name]), name
        assert torch.equal(bulk.eta, other.eta) and torch.equal(bulk.nu, other.nu)
        for x, y in zip(bulk.dense_kv(), other.dense_kv(), strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("mirror", [False, True, "lean"])
def test_a_deferred_commit_keeps_the_full_tail_until_the_next_token(mirror):
    """``defer_commit`` (the stores of a graphed decode): a tail block that fills stays the
    tail, full and exact, and the next token (or ``flush_tail``) commits it; the store then
    holds what a store committing at once holds, bit for bit (codes, annotations, Tier-2,
    tail, counts, maxima, mirror). A prompt of whole blocks keeps its last one as the tail."""
    k, v = make_kv(2, 75, 32, seed=2, outlier_channels=1)
    plain, deferred = (TieredKVStore(2, 32, block_size=8, value_group=8, decoded_mirror=mirror)
                       for _ in range(2))
    deferred.defer_commit = True
    for store in (plain, deferred):
        store.append(k[:, :32], v[:, :32])
    assert (deferred.num_blocks, deferred.tail_len) == (3, 8) and plain.tail_len == 0
    flushed = 0
    for t in range(32, 75):
        for store in (plain, deferred):
            store.append(k[:, t : t + 1], v[:, t : t + 1])
        full = deferred.tail_len == 8
        assert deferred.num_blocks == plain.num_blocks - full
        if full and t % 16 == 15:  # every other full tail committed by flush_tail
            deferred.flush_tail()
            flushed += 1
        if deferred.num_blocks == plain.num_blocks:
            assert all(torch.equal(a, b) for a, b in zip(store_contents(plain),
                                                         store_contents(deferred),
                                                         strict=True)), t
    assert flushed == 2 and deferred.num_blocks == plain.num_blocks == 9
    deferred.flush_tail()  # a partial tail: nothing to commit
    assert deferred.tail_len == 3


def test_blocks_are_quantized_from_their_own_tokens_and_never_updated():
    k, v = make_kv(1, 48, 16, seed=2)
    store = TieredKVStore(1, 16, block_size=16)
    store.append(k[:, :16], v[:, :16])
    first = {n: t.clone() for n, t in store.key_blocks().items()}
    store.append(k[:, 16:] * 100, v[:, 16:] * 100)  # wildly different later tokens
    for name, t in first.items():
        assert torch.equal(store.key_blocks()[name][:, :1], t)
    alone = ChannelAffineKeyCodec().encode(k[:, :16].half().reshape(1, 1, 16, 16))
    assert torch.equal(alone["scale"], first["scale"])


def test_tail_stays_fp16_and_tier2_holds_originals():
    k, v = make_kv(2, 21, 16, seed=3)
    store = TieredKVStore(2, 16, block_size=8, value_group=8)
    store.append(k, v)
    tail_k, tail_v = store.tail()
    assert tail_k.shape == (2, 5, 16) and tail_k.dtype == torch.float16
    assert torch.equal(tail_k, k[:, 16:].half()) and torch.equal(tail_v, v[:, 16:].half())
    dense_k, dense_v = store.dense_kv()
    assert torch.equal(dense_k, k.half()) and torch.equal(dense_v, v.half())
    kk, vv = store.fetch_originals(torch.tensor([1, 0]), torch.tensor([0, 1]))
    assert torch.equal(kk[0], k[1, :8].half()) and torch.equal(vv[1], v[0, 8:16].half())


def test_annotations_are_exact_upper_bounds():
    k, v = make_kv(2, 64, 32, seed=4, heavy_tail=True)
    store = TieredKVStore(2, 32, block_size=16)
    store.append(k, v)
    v16 = v.half().double().reshape(2, 4, 16, 32)
    err = (store.dequantized_values().double() - v16).norm(dim=-1).amax(dim=-1)
    assert (store.eta.double() >= err).all()
    assert (store.eta.double() - err).abs().max() <= 1e-6 * err.max()
    norm = v16.norm(dim=-1).amax(dim=-1)
    assert (store.nu.double() >= norm).all()


@pytest.mark.parametrize("key_bits", [8, 4, 2])
def test_tight_annotations_bound_the_brute_force_values(key_bits):
    """Every annotation is an upper bound of the quantity measured by brute force in FP64 and
    within a tiny factor of it (value and key error spectral norms, key error norms, radius)."""
    k, v = make_kv(2, 70, 32, seed=8, outlier_channels=2)
    v = v + 5.0  # a common offset: the centred radius is much smaller than V_max
    store = TieredKVStore(2, 32, block_size=16, value_group=8,
                          key_codec=ChannelAffineKeyCodec(bits=key_bits))
    store.append(k[:, :40], v[:, :40])
    store.append(k[:, 40:], v[:, 40:])
    n = store.num_blocks
    k16 = k[:, : 16 * n].half().double().reshape(2, n, 16, 32)
    v16 = v[:, : 16 * n].half().double().reshape(2, n, 16, 32)
    ev = store.dequantized_values().double() - v16
    ek = store.dequantized_keys().double() - k16
    centre = v[:, :40].half().float()
    centre = ((centre.amax(1) + centre.amin(1)) / 2).double()
    brute = {"value_spec": torch.linalg.matrix_norm(ev, ord=2),
             "key_err": ek.norm(dim=-1).amax(-1),
             "key_spec": torch.linalg.matrix_norm(ek, ord=2),
             "v_radius": (v16 - centre[:, None, None]).norm(dim=-1).amax(-1),
             "eta": ev.norm(dim=-1).amax(-1), "nu": v16.norm(dim=-1).amax(-1)}
    for name, exact in brute.items():
        got = store.annotation(name).double()
        assert (got >= exact).all(), name
        rel = 1e-3 if name.startswith("key") else 1e-6  # keys: plus the decode slack
        assert (got <= exact * (1 + rel) + 1e-30).all(), name
    assert (store.annotation("value_spec") <= store.eta * 4).all()  # B = 16: sqrt(B) eta max
    tail = v[:, 16 * n :].half().double()
    radius = torch.maximum(brute["v_radius"].amax(-1), (tail - centre[:, None]).norm(dim=-1)
                           .amax(-1))
    assert (store.value_radius().double() >= radius).all()
    assert (store.value_radius() < 0.7 * store.value_norm_max()).all()
    with pytest.raises(ConfigError, match="annotation 'sigma' is unknown"):
        store.annotation("sigma")


def test_clone_is_independent():
    k, v = make_kv(2, 50, 16, seed=9)
    store = TieredKVStore(2, 16, block_size=8, value_group=8, decoded_mirror=True)
    store.append(k[:, :45], v[:, :45])
    copy = store.clone()
    copy.append(k[:, 45:], v[:, 45:])
    assert store.num_tokens == 45 and copy.num_tokens == 50
    assert store.num_blocks == 5 and copy.num_blocks == 6
    for a, b in zip(store.dense_kv(), copy.dense_kv(), strict=True):
        assert torch.equal(a, b[:, :45])
    for name in ("eta", "key_spec", "v_radius"):
        assert torch.equal(store.annotation(name), copy.annotation(name)[:, :5])
    assert torch.equal(store.decoded_with_tail()[0][:, :5], copy.decoded_with_tail()[0][:, :5])



def test_clone_copies_every_field_a_store_has_including_ones_added_later():
    """``clone()`` derives from the fields: a tensor field a later change adds is copied, not
    shared (a hand list silently missed new fields); every tensor of the copy is its own
    memory, per-step caches start afresh, and the cloned counts' views are the copy's."""
    k, v = make_kv(2, 50, 16, seed=9)
    store = TieredKVStore(2, 16, block_size=8, value_group=8, decoded_mirror=True)
    store.append(k[:, :45], v[:, :45])
    store._a_field_added_later = torch.zeros(3)
    copy = store.clone()
    copy._a_field_added_later += 1
    assert torch.equal(store._a_field_added_later, torch.zeros(3))
    for name, value in vars(store).items():
        if isinstance(value, torch.Tensor) and value.numel():
            assert getattr(copy, name).data_ptr() != value.data_ptr(), name
    assert copy._views is None and copy._step_codes == {}
    assert copy._completed_count.data_ptr() == copy._counts.data_ptr()

def test_what_a_step_reads_in_place_stays_in_place_until_the_buffers_grow():
    """What a step over a padded layout reads (issue 24's bucketed block counts: a step
    captured in a graph replays on it): the quantized mask over the store's block capacity and
    the quantized-block count on the device follow the completions in place, the kernels'
    block and slot lists are views of one buffer that holds the capacity (a kernel reads them
    up to the device count; a list made before its buffer grew would end early), and every
    buffer grows with the annotations, so the graph signature changes exactly when the
    capacity does."""
    k, v = make_kv(2, 160, 16, seed=3)
    store = TieredKVStore(2, 16, block_size=8, value_group=8)
    store.append(k[:, :20], v[:, :20])
    seen = {}
    for end in range(21, 161):
        store.append(k[:, end - 1 : end], v[:, end - 1 : end])
        n, width = store.num_blocks, store.block_capacity()
        mask = store.quantized_mask(width - n)
        assert torch.equal(mask, torch.arange(width) < n)
        assert int(store.quantized_count()) == store.num_quantized() == n
        ptr = seen.setdefault((width, store.graph_signature()), mask.data_ptr())
        assert ptr == mask.data_ptr()  # in place while the signature holds
        ((_, _, blocks, slots),) = store.block_groups("key")
        for ids in (blocks, slots):
            assert ids.untyped_storage().nbytes() >= 8 * width
    assert {width for width, _ in seen} == {4, 8, 16, 32} and len(seen) == 4


@pytest.mark.parametrize(("d", "per_token"), [(128, 288), (64, 144)])
def test_byte_accounting_matches_table_13(d, per_token):
    k, v = make_kv(2, 160, d, seed=5)
    store = TieredKVStore(2, d)  # paper defaults: B=16, g=16, INT8 keys, INT4 values
    store.append(k, v)
    tokens = store.num_tokens * store.num_kv_heads
    assert store.tier1_bytes() == per_token * tokens
    assert store.tier1_bytes() / store.dense_bytes() == pytest.approx(per_token / (4 * d))
    assert store.tier2_bytes() == store.dense_bytes() == 4 * d * tokens
    assert store.annotation_bytes() == 24 * store.num_blocks * store.num_kv_heads
    store.append(k[:, :3], v[:, :3])
    assert store.tail_bytes() == 4 * d * 3 * 2
    assert store.device_bytes() == (store.tier1_bytes() + store.annotation_bytes()
                                    + store.tail_bytes())


def test_dropping_tier2_refuses_promotion():
    k, v = make_kv(1, 32, 16, seed=6)
    store = TieredKVStore(1, 16)
    store.append(k, v)
    store.drop_originals()
    with pytest.raises(Tier2UnavailableError, match="keep_originals=True"):
        store.dense_kv()
    assert store.tier2_bytes() == 0


@pytest.mark.parametrize(("k", "v", "error", "match"), [
    (torch.zeros(2, 4), torch.zeros(2, 4), ShapeError, "3-D tensor"),
    (torch.zeros(3, 4, 16), torch.zeros(3, 4, 16), ShapeError, "expects"),
    (torch.zeros(2, 4, 8), torch.zeros(2, 4, 8), ShapeError, "expects"),
    (torch.zeros(2, 4, 16), torch.zeros(2, 3, 16), ShapeError, "same number"),
    (torch.zeros(2, 0, 16), torch.zeros(2, 0, 16), ShapeError, "T >= 1"),
    (torch.zeros(2, 4, 16, dtype=torch.long), torch.zeros(2, 4, 16), ShapeError, "floating"),
    (torch.full((2, 4, 16), float("nan")), torch.zeros(2, 4, 16), NonFiniteError, "NaN"),
    (torch.zeros(2, 4, 16), torch.full((2, 4, 16), 1e6), NonFiniteError, "FP16 range"),
])
def test_bad_append_gives_one_clear_sentence(k, v, error, match):
    store = TieredKVStore(2, 16)
    with pytest.raises(error, match=match):
        store.append(k, v)
    assert store.num_tokens == 0


def test_a_store_made_under_inference_mode_names_the_fix_outside_it():
    k, v = make_kv(2, 20, 32, seed=0)
    with torch.inference_mode():
        store = TieredKVStore(2, 32, block_size=8, value_group=8, decoded_mirror="lean")
        store.append(k, v)
    for append in (store.append, store.append_in_place):
        with pytest.raises(ConfigError, match=r"inference_mode too, or continue on store\.clone"):
            append(k[:, :1], v[:, :1])
    copy = store.clone()  # made outside the mode: writable there
    copy.append(k[:, :5], v[:, :5])
    assert copy.num_tokens == 25 and store.num_tokens == 20


def test_bad_store_configuration_names_the_fix():
    with pytest.raises(ConfigError, match="does not divide head_dim=24"):
        TieredKVStore(1, 24, value_group=16)
    with pytest.raises(ConfigError, match="block_size=0 must be a positive integer"):
        TieredKVStore(1, 16, block_size=0)
    with pytest.raises(ConfigError, match="multiple of 4"):
        TieredKVStore(1, 6, value_group=2, value_codec=GroupAffineValueCodec(bits=2, group=2))


def test_a_lossless_store_keeps_its_originals_in_tier1_and_reads_them_without_copies():
    k, v = make_kv(2, 53, 16, seed=4)
    store = TieredKVStore(2, 16, key_codec=FP16KeyCodec(), value_codec=FP16ValueCodec())
    store.append(k[:, :40], v[:, :40])
    store.append(k[:, 40:], v[:, 40:])
    assert store.lossless and store.tier2_bytes() == 0
    dk, dv = store.dense_kv()
    assert torch.equal(dk, k.half()) and torch.equal(dv, v.half())
    assert dk.untyped_storage().data_ptr() == store.key_blocks()["data"].untyped_storage(
    ).data_ptr()  # a view of Tier-1, not a copy
    kk, vv = store.fetch_originals(torch.tensor([1, 0]), torch.tensor([2, 0]))
    assert torch.equal(kk[0], k[1, 32:48].half()) and torch.equal(vv[1], v[0, :16].half())
    hk, _ = store.dense_kv(torch.tensor([1]))
    assert torch.equal(hk[0], k[1].half())


@pytest.mark.parametrize("mirror", [True, "lean", False])
def test_a_decode_tokens_fused_append_matches_the_torch_path(monkeypatch, mirror):
    """One token per append on a CPU store (:mod:`certkv.cache.append_cpu`): the tail, the
    running key and value maxima and the decoded mirror's tail row as the PyTorch path leaves
    them, through a block completion; a NaN token raises and changes nothing."""
    import certkv.cache.append_cpu as append_cpu

    k, v = make_kv(3, 70, 32, seed=5, outlier_channels=2)
    stores = [TieredKVStore(3, 32, block_size=16, decoded_mirror=mirror) for _ in range(2)]
    for store in stores:
        store.append(k[:, :37], v[:, :37])
    fused, plain = stores
    calls, kernel = [], append_cpu.append
    monkeypatch.setattr(append_cpu, "append", lambda *args: calls.append(1) or kernel(*args))
    for t in range(37, 70):
        fused.append(k[:, t:t + 1], v[:, t:t + 1])
        with monkeypatch.context() as patch:
            patch.setattr(append_cpu, "covers", lambda *args: False)
            plain.append(k[:, t:t + 1], v[:, t:t + 1])
        assert fused.tail_len == plain.tail_len
        for name in ("_tail_k", "_tail_v", "_key_abs_max", "_tail_maxima", "_value_maxima"):
            assert torch.equal(getattr(fused, name), getattr(plain, name)), (t, name)
        if mirror:
            for got, want in zip(fused.decoded_with_tail(), plain.decoded_with_tail(),
                                 strict=True):
                assert got is want is None or torch.equal(got, want)  # lean: no keys
            assert torch.equal(fused.original_keys(), plain.original_keys())
            assert torch.equal(fused.slot_bias(), plain.slot_bias())
    assert len(calls) == 33 - 2  # all but the two tokens that complete a block
    before = fused._tail_k.clone(), fused.tail_len, fused._key_abs_max.clone()
    bad = k[:, :1].clone()
    bad[1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteError):
        fused.append(bad, v[:, :1])
    assert torch.equal(fused._tail_k, before[0]) and fused.tail_len == before[1]
    assert torch.equal(fused._key_abs_max, before[2])


def test_a_lean_mirror_keeps_what_the_cpu_loops_read():
    """``decoded_mirror="lean"`` keeps the key bounds and slot bias only where every block's
    keys are the one INT8 precision's codes or exact windows and its values the one 4-bit
    group precision's or exact (the CPU loops decode the codes and read FP16 originals in
    place): under 5% of the whole mirror; other value codecs add the decoded values. Other key
    codecs, protected words, eviction or a store without Tier-2 keep the whole mirror; an
    unknown kind and dropping the originals a lean mirror reads name the fix."""
    from certkv.evict import SnapKVEviction
    from certkv.quant import KVQuantizer
    from certkv.quant.protect.protection import Protection

    k, v = make_kv(2, 16 * 12 + 5, 32, seed=2)
    sizes = {}
    for kind in (True, "lean"):
        store = TieredKVStore(2, 32, quantizer=KVQuantizer(sink=16, residual=32),
                              decoded_mirror=kind)
        store.append(k, v)
        sizes[kind] = store.workspace_bytes()
        assert len(store.decoded_with_tail()) == 2
    assert store._mirror_fields == ("bound", "bias")
    assert store.decoded_with_tail()[0] is None and store.decoded_with_tail()[1] is None
    assert torch.equal(store.original_keys()[:, :12],
                       k[:, :192].half().float().view(2, 12, 16, 32))
    assert sizes["lean"] < 0.05 * sizes[True]
    two_bit = TieredKVStore(2, 32, value_codec=GroupAffineValueCodec(bits=2),
                            decoded_mirror="lean")
    assert two_bit._mirror_fields == ("v", "bound", "bias")
    for kwargs in ({"key_codec": ChannelAffineKeyCodec(bits=4)}, {"keep_originals": False},
                   {"quantizer": KVQuantizer().with_protection(Protection("hamming84"))},
                   {"quantizer": KVQuantizer().with_eviction(SnapKVEviction(budget=0.3))}):
        lean = TieredKVStore(2, 32, decoded_mirror="lean", **kwargs)
        assert lean._mirror_fields == TieredKVStore(2, 32, decoded_mirror=True)._mirror_fields
    with pytest.raises(ConfigError, match="use True, False or 'lean'"):
        TieredKVStore(2, 32, decoded_mirror="half")
    with pytest.raises(ConfigError, match="decoded_mirror=True to drop the originals"):
        store.drop_originals()


def test_a_quantizer_made_for_another_block_size_is_refused():
    """Before: a store of B=16 holding a quantizer made for 32 ran every step on rung 4."""
    with pytest.raises(ConfigError, match="block_size=16 differs from the quantizer's "
                                          "block_size=32"):
        TieredKVStore(1, 32, block_size=16, quantizer=KVQuantizer(block_size=32))
    assert TieredKVStore(1, 32, quantizer=KVQuantizer(block_size=32)).block_size == 32


@pytest.mark.parametrize("policy", [AgeEviction(budget=0.5, min_materialized=16),
                                    SnapKVEviction(budget=0.5, window=8)])
def test_observing_no_certificate_or_misshapen_prompt_queries_is_one_sentence(policy):
    quantizer = KVQuantizer(block_size=8).with_eviction(policy)
    store = TieredKVStore(2, 16, **quantizer.store_kwargs())
    store.append(*make_kv(2, 40, 16))
    with pytest.raises(ConfigError, match=r"store\.observe takes the Certificate a step returned"):
        store.observe(None)
    if store.wants_prompt:
        for bad in (torch.randn(3, 8, 16), torch.randn(2, 8, 12), torch.randn(2, 16)):
            with pytest.raises(ConfigError, match=r"observe_prompt takes queries \[Hq, T, d\]"):
                store.observe_prompt(bad)
        store.observe_prompt(torch.randn(4, 8, 16))  # Hq = 2 x Hkv: accepted


def unrotatable(n: int, start: int = 0) -> torch.Tensor:
    """Post-RoPE keys ``[1, n, 64]`` that a pre-RoPE codec with ``attention_scaling`` 0.5
    refuses: unrotated, they leave FP16's range (tokens from ``start`` on)."""
    k = torch.zeros(1, n, 64, dtype=torch.float16)
    k[:, start:] = 6e4
    return k


def pre_rope_store(defer_commit: bool = False) -> TieredKVStore:
    from certkv.quant.prerope import PreRoPEKeyCodec
    from certkv.quant.rope import RopeSpec

    rope = RopeSpec(RopeSpec.from_theta(1e5, 64).inv_freq, 0.5)  # SmolLM2's, scaled by 0.5
    keys = PreRoPEKeyCodec(ChannelAffineKeyCodec(bits=8), rope=rope)
    store = TieredKVStore(1, 64, quantizer=KVQuantizer(keys, GroupAffineValueCodec()))
    store.defer_commit = defer_commit
    return store


def budget_store(path: str) -> TieredKVStore:
    """A store whose budget no arrangement of 48 tokens meets (AgeEviction at 10%: the newest
    64 tokens stay; ``budget_bytes`` below three INT8/INT4 blocks), holding 8 tail tokens."""
    from certkv.evict import AgeEviction

    quantizer = KVQuantizer(block_size=16)
    if path == "over an eviction budget":
        quantizer = quantizer.with_eviction(AgeEviction(budget=0.1, min_materialized=64))
    else:
        quantizer = replace(quantizer, budget_bytes=2000)
    store = TieredKVStore(1, 64, **quantizer.store_kwargs())
    store.append(*make_kv(1, 8, 64, seed=1))
    return store


def refused_append(path: str):
    """``(store, append, bad k/v, error)``: a store and an append of it that must raise."""
    if path.startswith("over"):
        return budget_store(path), "append", make_kv(1, 40, 64, seed=2), BudgetError
    store = pre_rope_store(defer_commit=path == "deferred full tail")
    store.append(*make_kv(1, 40, 64, seed=1))  # 2 blocks and 8 tail tokens (32-39)
    if path == "prompt":
        return store, "append", (unrotatable(20, start=4), torch.zeros(1, 20, 64)), ConfigError
    if path in ("token completing a block", "deferred full tail"):
        store.append(*make_kv(1, 7, 64, seed=2))  # the tail: one token short of a block
        return store, "append", (unrotatable(1), torch.zeros(1, 1, 64)), ConfigError
    bad = (torch.full((1, 1, 64), float("nan")), torch.zeros(1, 1, 64))
    if path == "one numba token":
        return store, "append", bad, NonFiniteError
    return store, "append_in_place", tuple(x.expand(2, 1, 64) for x in bad), ShapeError


@pytest.mark.parametrize("path", ["prompt", "token completing a block", "deferred full tail",
                                  "one numba token", "in place", "over an eviction budget",
                                  "over budget_bytes"])
def test_an_append_that_raises_leaves_the_store_exactly_as_it_was(path):
    """Every append path checks what it appends before it changes anything (keys a precision
    cannot encode, non-finite values, shapes, a budget no arrangement of the blocks meets): a
    refused append can be retried (or skipped) without a duplicated token, and the store
    reads as before."""
    store, append, bad, error = refused_append(path)
    before, tokens = [x.clone() for x in store_contents(store)], store.num_tokens
    tail = [x.clone() for x in store.tail_buffers()]
    with pytest.raises(error):
        getattr(store, append)(*bad)
    assert store.num_tokens == tokens
    assert all(torch.equal(a, b) for a, b in zip(store_contents(store), before, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(store.tail_buffers(), tail, strict=True))
