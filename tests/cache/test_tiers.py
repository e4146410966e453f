"""What a user relies on from the mixed-precision stores (issue 20), beyond the certificate
contract (``test_tiers_contract``): blocks graduate at the stated ages, KIVI's residual window,
re-quantization from the FP16 originals, byte accounting with slot reuse, the Tier-1 budget,
certificate-driven boundaries with their JSON store, and the ``quantizer`` config group.

Small shapes throughout: ``Hkv = 2``, ``d = 32``, ``B = 8``.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from helpers import make_kv

from certkv import CertifiedAttention
from certkv.cache import thresholds
from certkv.cache.store import ANNOTATIONS, TieredKVStore, block_annotations
from certkv.cache.thresholds import AdaptiveThresholds, ThresholdTracker
from certkv.errors import BudgetError, ConfigError
from certkv.quant import (
    GroupAffineValueCodec,
    KiviKeyCodec,
    KVQuantizer,
    Precision,
    RotatedKeyCodec,
    RotatedValueCodec,
    TieredQuantizer,
)

HKV, D, B = 2, 32, 8
HOT, STALE = 16, 48


def tiers(**changes) -> TieredQuantizer:
    """Hot < 16 exact, warm < 48 4-bit KIVI, a fixed archive (2-bit KIVI by default); every
    codec a distinct object, so a spy on one sees only its own precision's encodes."""
    archives = {name: Precision(KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=32))
                for name in ("kivi2", "kvquant")}
    archives["rotation"] = Precision(RotatedKeyCodec(bits=2, subspaces=4),
                                     RotatedValueCodec(bits=2, subspaces=4))
    options = {"key_codec": KiviKeyCodec(bits=4),
               "value_codec": GroupAffineValueCodec(bits=4, group=32), "block_size": B,
               "hot": HOT, "stale": STALE, "archive": "kivi2", "archives": archives}
    options.update(changes)
    return TieredQuantizer(**options)


def names(store: TieredKVStore) -> list[str]:
    """The precision name holding each completed block, oldest first."""
    return [store.precisions[int(p)].name for p in store._table.precision]


def tier_of(b: int, n: int, hot: int = HOT, stale: int = STALE, sink: int = 0,
            archive: str = "archive-kivi2") -> str:
    """The tier block ``b`` of a sequence of ``n`` tokens is held at, by its age alone."""
    age = n - (b + 1) * B
    if b < -(-sink // B) or age < hot:
        return "exact"
    return "warm" if age < stale else archive


def spy(monkeypatch, codec) -> list[int]:
    """Record the number of blocks of every ``encode_at`` call of ``codec``."""
    calls: list[int] = []
    original = codec.encode_at

    def encode_at(k, start, layer=None):
        calls.append(int(k.shape[1]))
        return original(k, start, layer)

    monkeypatch.setattr(codec, "encode_at", encode_at)
    return calls


def stream(store: TieredKVStore, k: torch.Tensor, v: torch.Tensor, start: int = 0):
    """Append tokens ``start ..`` of ``k, v`` one at a time, yielding the token count after
    each append."""
    for i in range(start, k.shape[1]):
        store.append(k[:, i:i + 1], v[:, i:i + 1])
        yield i + 1


def block_originals(k, v, blocks):
    """FP16 originals ``[Hkv, m, B, d]`` of ``blocks`` (a list) of tokens ``k, v [Hkv, N, d]``."""
    idx = torch.tensor(blocks)
    shape = (HKV, -1, B, D)
    return (k.half()[:, :len(k[0]) // B * B].reshape(shape)[:, idx],
            v.half()[:, :len(v[0]) // B * B].reshape(shape)[:, idx])


# ---------------------------------------------------------------- 1. graduation by age
def test_blocks_graduate_at_the_stated_ages_one_token_at_a_time(monkeypatch):
    q = tiers(sink=8)
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    archive_calls = spy(monkeypatch, q.archives["kivi2"].key_codec)
    k, v = make_kv(HKV, 120, D, seed=1)
    for n in stream(store, k, v):
        expected = [tier_of(b, n, sink=8) for b in range(n // B)]
        assert names(store) == expected, f"after {n} tokens"
        assert store.num_quantized() == sum(name != "exact" for name in expected)
    assert names(store)[0] == "exact"  # the sink block, whatever its age
    # every archived block was encoded at the archive precision exactly once
    assert sum(archive_calls) == names(store).count("archive-kivi2") > 0


def test_a_prefill_lands_every_block_at_its_age_encoded_once(monkeypatch):
    q = tiers(sink=8)
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    archive_calls = spy(monkeypatch, q.archives["kivi2"].key_codec)
    warm_calls = spy(monkeypatch, q.key_codec)
    k, v = make_kv(HKV, 100, D, seed=2)
    store.append(k, v)
    expected = [tier_of(b, 100, sink=8) for b in range(100 // B)]
    assert names(store) == expected
    assert expected.count("archive-kivi2") == 5 and expected.count("warm") == 4
    assert archive_calls == [5]  # one encode of the five archive blocks, no re-quantization
    assert warm_calls == [4]
    # the next tokens graduate the prefill's blocks by age as usual
    more_k, more_v = make_kv(HKV, 20, D, seed=3)
    for i in range(20):
        store.append(more_k[:, i:i + 1], more_v[:, i:i + 1])
        n = 101 + i
        assert names(store) == [tier_of(b, n, sink=8) for b in range(n // B)]


# ---------------------------------------------------------------- 2. KIVI's residual
@pytest.mark.parametrize("prefill", [0, 61])
@pytest.mark.parametrize("residual", [0, 32])
def test_kivi_residual_keeps_exactly_the_young_blocks_exact(prefill, residual):
    q = KVQuantizer(KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=32), B,
                    residual=residual)
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    k, v = make_kv(HKV, 110, D, seed=4)
    if prefill:
        store.append(k[:, :prefill], v[:, :prefill])

    def check(n):
        ages = n - (torch.arange(n // B) + 1) * B
        quantized = ages >= residual
        assert names(store) == ["quantized" if x else "exact" for x in quantized.tolist()]
        assert torch.equal(store.quantized_mask().cpu(), quantized)
        assert store.num_quantized() == int(quantized.sum())

    check(prefill)
    for n in stream(store, k, v, start=prefill):
        check(n)


# ---------------------------------------------------------------- 3. from the originals
@pytest.mark.parametrize("mirror", [False, True])
@pytest.mark.parametrize("archive", ["kivi2", "rotation"])
def test_requantization_starts_from_the_fp16_originals(archive, mirror):
    q = tiers(archive=archive)
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q, decoded_mirror=mirror)
    k, v = make_kv(HKV, 90, D, seed=5, outlier_channels=2)
    warm_codes = None
    for n in stream(store, k, v):
        if n == HOT + B:  # block 0 just went warm: keep its warm reconstruction
            assert names(store)[0] == "warm"
            warm_codes = store.dequantized_keys()[:, 0].clone()
    assert warm_codes is not None
    name = f"archive-{archive}"
    archived = [b for b, held in enumerate(names(store)) if held == name]
    assert archived == list(range(len(archived))) and len(archived) >= 4
    precision = store.precisions[int(store._table.precision[0])]
    kc, vc = precision.key_codec, precision.value_codec
    k16, v16 = block_originals(k, v, archived)
    kb = kc.encode_at(k16, torch.tensor(archived) * B)
    vb = vc.encode(v16)
    idx = torch.tensor(archived)
    assert torch.equal(store.dequantized_keys()[:, idx], kc.decode(kb))
    assert torch.equal(store.dequantized_values()[:, idx], vc.decode(vb))
    if mirror:  # what the reference path reads instead of decoding Tier-1
        mk, mv = store.decoded_with_tail()
        assert torch.equal(mk[:, idx], kc.decode(kb)) and torch.equal(mv[:, idx], vc.decode(vb))
    notes = block_annotations(k16, v16, kc, vc, kb, vb, store.centre)
    for note in ANNOTATIONS:
        assert torch.equal(store.annotation(note)[:, idx], notes[note]), note
    # encoding the warm reconstruction instead would give other codes (the test can tell)
    via_codes = kc.decode(kc.encode_at(warm_codes[:, None].half(), torch.tensor([0])))
    assert not torch.equal(via_codes[:, 0], kc.decode(kb)[:, 0])


# ---------------------------------------------------------------- 4. byte accounting
def expected_bytes(store: TieredKVStore, k: torch.Tensor, v: torch.Tensor) -> dict[str, int]:
    """Tier-1 bytes per precision name, from encoding each block's originals with its codec."""
    out = {p.name: 0 for p in store.precisions}
    for b in range(store.num_blocks):
        precision = store.precisions[int(store._table.precision[b])]
        k16, v16 = block_originals(k, v, [b])
        codes = [*precision.key_codec.encode_at(k16, torch.tensor([b * B])).values(),
                 *precision.value_codec.encode(v16).values()]
        out[precision.name] += sum(t.nbytes for t in codes)
    return out


def test_tier1_bytes_are_the_live_blocks_codes_at_their_precisions():
    store = TieredKVStore(HKV, D, block_size=B, quantizer=tiers(sink=8))
    k, v = make_kv(HKV, 140, D, seed=6)
    for n in stream(store, k, v):
        if n % 11 and n != 140:
            continue
        expected = expected_bytes(store, k, v)
        assert store.precision_bytes() == expected, f"after {n} tokens"
        assert store.tier1_bytes() == sum(expected.values())
        assert sum(store.precision_bytes().values()) == store.tier1_bytes()
    held = set(names(store))
    assert held == {"exact", "warm", "archive-kivi2"}


def test_freed_slots_are_reused_over_a_long_stream():
    store = TieredKVStore(HKV, D, block_size=B, quantizer=tiers())
    table = store._table
    exact_id, warm_id, archive_id = 0, 1, 2
    assert [p.name for p in store.precisions[:3]] == ["exact", "warm", "archive-kivi2"]
    k, v = make_kv(HKV, 400, D, seed=7)
    for n in stream(store, k, v):
        assert table._keys[warm_id].size <= (STALE - HOT) // B + 1, f"after {n} tokens"
        assert table._keys[exact_id].size <= HOT // B + 1, f"after {n} tokens"
        for pid in range(len(store.precisions)):
            live = int((table.precision == pid).sum())
            assert table._keys[pid].size == live + len(table._free[pid])
            assert table._values[pid].size == table._keys[pid].size
        # the archive never frees a slot: it holds exactly its blocks
        assert table._keys[archive_id].size == int((table.precision == archive_id).sum())
    assert store.num_blocks == 50


# ---------------------------------------------------------------- 5. the budget
def test_budget_is_never_exceeded_and_the_oldest_graduate_first():
    free_q = tiers(sink=8, stale=10_000)  # without a budget nothing would reach the archive
    k, v = make_kv(HKV, 200, D, seed=8)
    free = TieredKVStore(HKV, D, block_size=B, quantizer=free_q)
    free.append(k, v)
    budget = int(0.85 * free.tier1_bytes())
    # feasible: the sink block exact and every other at the archive fits the budget
    exact_block = free._table._keys[0].block_bytes() + free._table._values[0].block_bytes()
    archive_block = sum(t.nbytes for t in (
        *free_q.archives["kivi2"].key_codec.encode(k.half()[:, None, :B]).values(),
        *free_q.archives["kivi2"].value_codec.encode(v.half()[:, None, :B]).values()))
    assert free.num_blocks == 25 and exact_block + 24 * archive_block <= budget
    q = tiers(sink=8, stale=10_000, budget_bytes=budget)
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    unconstrained = TieredKVStore(HKV, D, block_size=B, quantizer=free_q)
    early = False
    for n in stream(store, k, v):
        unconstrained.append(k[:, n - 1:n], v[:, n - 1:n])
        assert store.tier1_bytes() <= budget, f"after {n} tokens"
        held = names(store)
        assert held[:1] in ([], ["exact"])  # the sink block never graduates
        archived = [name == "archive-kivi2" for name in held[1:]]
        # the archive is a prefix of the non-sink blocks: the oldest went first
        assert archived == sorted(archived, reverse=True), f"after {n} tokens: {held}"
        if unconstrained.tier1_bytes() <= q.memory_threshold * budget:
            assert not any(archived) and store.tier1_bytes() == unconstrained.tier1_bytes()
        early = early or any(archived)
    assert early and names(store)[-1] == "exact"  # the newest block is the last to go


def test_an_infeasible_budget_is_one_sentence_naming_the_fix():
    store = TieredKVStore(HKV, D, block_size=B, quantizer=tiers(budget_bytes=100))
    k, v = make_kv(HKV, 40, D, seed=9)
    store.append(k[:, :7], v[:, :7])  # no completed block yet: nothing to hold
    with pytest.raises(BudgetError) as caught:
        store.append(k[:, 7:], v[:, 7:])
    message = str(caught.value)
    assert "budget_bytes=100" in message and "raise the budget" in message
    assert message.endswith(".") and ". " not in message and "\n" not in message


# ---------------------------------------------------------------- 6. adaptive boundaries
def certificate(rungs, bound=0.0):
    """A fake certificate: ``rung [H]`` and ``e_key + e_val = bound`` per head."""
    rung = torch.tensor(rungs)
    half = torch.full(rung.shape, bound / 2)
    return SimpleNamespace(rung=rung, e_key=half, e_val=half.clone())


CHEAP = certificate([0] * 8, bound=0.01)
DENSE = certificate([0] * 7 + [3], bound=0.01)  # 1/8 dense > dense_rate
LOOSE = certificate([0] * 8, bound=0.2)  # mean bound over target
SOME_PROMOTED = certificate([2, 2, 2, 0, 0, 0, 0, 0], bound=0.01)  # 3/8: in (rate, 2 rate]


def rule(**changes) -> AdaptiveThresholds:
    options = {"window": 4, "bound_target": 0.05, "promotion_rate": 0.25, "dense_rate": 0.1,
               "grow": 1.5, "shrink": 0.5, "hot_limits": [8, 64], "stale_limits": [32, 256]}
    options.update(changes)
    return AdaptiveThresholds(**options)


def feed(tracker: ThresholdTracker, cert, steps: int) -> list[list[int]]:
    """Observe ``cert`` ``steps`` times; the boundaries after each."""
    out = []
    for _ in range(steps):
        tracker.observe(cert)
        out.append(list(tracker.ages))
    return out


def test_cheap_windows_archive_more_down_to_the_limits():
    tracker = rule().tracker([32, 128])
    assert feed(tracker, CHEAP, 4) == [[32, 128]] * 3 + [[16, 64]]  # only every window
    assert feed(tracker, CHEAP, 8)[3::4] == [[8, 32], [8, 32]]  # clamped at the low limits
    assert [h["verdict"] for h in tracker.history] == ["archive more"] * 3
    assert tracker.history[0]["step"] == 4 and tracker.history[0]["promotion"] == 0


@pytest.mark.parametrize("cert", [DENSE, LOOSE, certificate([2] * 8)], ids=["dense", "loose",
                                                                          "promoted"])
def test_costly_windows_archive_less_up_to_the_limits(cert):
    tracker = rule().tracker([32, 128])
    assert feed(tracker, cert, 4)[-1] == [48, 192]
    assert feed(tracker, cert, 4)[-1] == [64, 256]  # 72 and 288, clamped
    assert feed(tracker, cert, 4)[-1] == [64, 256]
    assert [h["verdict"] for h in tracker.history] == ["archive less"] * 3


def test_a_window_in_between_keeps_the_boundaries():
    tracker = rule().tracker([32, 128])
    assert feed(tracker, SOME_PROMOTED, 8) == [[32, 128]] * 8
    assert [h["verdict"] for h in tracker.history] == ["keep", "keep"]
    assert tracker.history[0]["promotion"] == pytest.approx(3 / 8)
    # a decision averages its whole window: one dense step in four is 1/32 dense heads
    tracker = rule(dense_rate=0.05).tracker([32, 128])
    for cert in (DENSE, CHEAP, CHEAP, CHEAP):
        tracker.observe(cert)
    assert tracker.history[-1]["verdict"] == "archive more" and tracker.ages == [16, 64]


def test_hot_never_exceeds_stale():
    gen = torch.Generator().manual_seed(0)
    tracker = rule(window=1, hot_limits=[0, 500], stale_limits=[10, 100]).tracker([50, 60])
    for i in torch.randint(0, 3, (200,), generator=gen).tolist():
        tracker.observe((CHEAP, DENSE, SOME_PROMOTED)[i])
        hot, stale = tracker.ages
        assert 0 <= hot <= 500 and hot <= stale


def test_store_observe_moves_its_boundaries_for_later_graduations():
    q = tiers(adaptive=rule(window=2))
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    k, v = make_kv(HKV, 100, D, seed=10)
    store.append(k[:, :60], v[:, :60])
    store.observe(CHEAP)
    assert store.boundaries == [HOT, STALE]
    store.observe(CHEAP)
    assert store.boundaries == [8, 32]  # 16 * 0.5 and 48 * 0.5 (clamped up to 32)
    assert q.hot == HOT and q.stale == STALE  # the quantizer (shared by layers) is untouched
    store.append(k[:, 60:61], v[:, 60:61])
    assert names(store) == [tier_of(b, 61, 8, 32) for b in range(61 // B)]
    # growing boundaries never bring a block back to a finer precision
    before = store.stages.stage.clone()
    for _ in range(4):
        store.observe(DENSE)
    assert store.boundaries == [18, 72]
    for _ in stream(store, k, v, start=61):
        stage = store.stages.stage
        assert (stage[:len(before)] >= before).all()
        before = stage.clone()
        assert names(store)[-1] == "exact"


def test_lower_boundaries_graduate_due_blocks_at_once():
    store = TieredKVStore(HKV, D, block_size=B, quantizer=tiers())
    k, v = make_kv(HKV, 60, D, seed=11)
    store.append(k, v)
    assert names(store) == [tier_of(b, 60) for b in range(7)]
    store.boundaries = [8, 24]
    assert store.boundaries == [8, 24]
    assert names(store) == [tier_of(b, 60, 8, 24) for b in range(7)]  # no append needed
    with pytest.raises(ConfigError, match="stage ages"):
        store.boundaries = [8]


@pytest.mark.parametrize("how", ["observe", "boundaries"])
def test_a_hot_tier_opened_at_run_time_is_exact(how):
    q = tiers(hot=0, adaptive=rule(window=1))
    store = TieredKVStore(HKV, D, block_size=B, quantizer=q)
    if how == "observe":
        store.observe(SOME_PROMOTED)  # "keep", but hot clamps up to hot_limits[0] = 8
    else:
        store.boundaries = [8, STALE]  # what TieredCache.load_thresholds does
    assert store.boundaries == [8, STALE]
    k, v = make_kv(HKV, 30, D, seed=13)
    store.append(k, v)
    assert names(store) == [tier_of(b, 30, 8) for b in range(3)]  # [warm, warm, exact]


def test_thresholds_round_trip_per_model(tmp_path):
    path = tmp_path / "thresholds.json"
    thresholds.save(path, "llama", {0: [16, 48], 1: [24, 96]})
    thresholds.save(path, "qwen", {0: [32, 64]})
    assert thresholds.load(path, "llama") == {0: [16, 48], 1: [24, 96]}
    assert thresholds.load(path, "qwen") == {0: [32, 64]}
    thresholds.save(path, "llama", {0: [8, 32]})  # replaces llama's entry only
    assert thresholds.load(path, "llama") == {0: [8, 32]}
    assert thresholds.load(path, "qwen") == {0: [32, 64]}
    assert sorted(json.loads(path.read_text())) == ["llama", "qwen"]
    with pytest.raises(ConfigError, match=r"run once with quantizer\.adaptive set and save"):
        thresholds.load(tmp_path / "missing.json", "llama")
    with pytest.raises(ConfigError, match=r"not for model 'mistral'; save them for this model"):
        thresholds.load(path, "mistral")


def test_tiered_cache_applies_loaded_thresholds_to_stores_made_later(tmp_path):
    from certkv.models.hf_cache import TieredCache

    path = tmp_path / "thresholds.json"
    thresholds.save(path, "tiny", {0: [8, 24], 1: [24, 40]})
    cache = TieredCache(2, CertifiedAttention(backend="torch"), quantizer=tiers())
    assert cache.boundaries() == {}
    cache.load_thresholds(path, "tiny")
    k, v = make_kv(HKV, 60, D, seed=12)
    for layer in cache.layers:
        layer.update(k[None], v[None])
    assert cache.boundaries() == {0: [8, 24], 1: [24, 40]}
    assert names(cache.layers[0].store) == [tier_of(b, 60, 8, 24) for b in range(7)]
    assert names(cache.layers[1].store) == [tier_of(b, 60, 24, 40) for b in range(7)]
    cache.save_thresholds(path, "other")
    assert thresholds.load(path, "other") == {0: [8, 24], 1: [24, 40]}
    # existing stores take newly loaded thresholds at once
    thresholds.save(path, "tiny", {0: [0, 0]})
    cache.load_thresholds(path, "tiny")
    assert cache.boundaries() == {0: [0, 0], 1: [24, 40]}
    assert set(names(cache.layers[0].store)) == {"archive-kivi2"}


# ---------------------------------------------------------------- 7. config
def test_the_tiers_config_builds_a_tiered_quantizer():
    from certkv.config import compose_config
    from certkv.eval.runner import build

    cfg = compose_config(["quantizer=tiers", "quantizer.archive=rotation"])
    q = build(cfg.quantizer, "quantizer")
    assert isinstance(q, TieredQuantizer)
    assert (q.hot, q.stale, q.archive, q.block_size) == (64, 512, "rotation", 32)
    assert isinstance(q.archives, dict)
    assert all(isinstance(p, Precision) for p in q.archives.values())
    assert isinstance(q.archives["rotation"].key_codec, RotatedKeyCodec)
    assert [p.name for p in q.precisions()] == ["exact", "warm", "archive-kivi2",
                                                "archive-rotation", "archive-kvquant"]
    assert q.stage_precision(2, 100) == 3  # the fixed archive, whatever the length
    store = TieredKVStore(HKV, D, **q.store_kwargs())
    assert store.block_size == 32 and store.boundaries == [64, 512]


def test_the_option_resolver_and_bad_tier_settings():
    from certkv.config import option

    assert option("quantizer", "tiers", "archive=kvquant")["archive"] == "kvquant"
    assert option("quantizer", "tiers", "hot=8")["hot"] == 8
    with pytest.raises(ConfigError) as caught:
        option("quantizer", "nope")
    assert "conf/quantizer/nope.yaml" in str(caught.value)
    assert all(name in str(caught.value) for name in ("kivi2", "kivi4", "tiers"))
    with pytest.raises(ConfigError, match="must read key=value"):
        option("quantizer", "tiers", "archive")
    for changes, words in (({"hot": 100, "stale": 50}, "0 <= hot <= stale"),
                           ({"archive": "nope"}, "use auto or one of"),
                           ({"residual": 8}, "set hot, not residual")):
        with pytest.raises(ConfigError, match=words) as caught:
            TieredQuantizer(**changes)
        message = str(caught.value)
        assert message.endswith(".") and "\n" not in message
