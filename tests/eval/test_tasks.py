"""The evaluation protocol's public API (Method, Prefill, Session, Decoder) and the paper's
tasks (RULER, ten-needle NIAH, PG-19-style perplexity) on a tiny random model."""

from __future__ import annotations

import gc
import math

import pytest
import torch

from certkv import TieredKVStore
from certkv.errors import CertKVError
from certkv.eval import decode
from certkv.eval.corpora import corpus_windows
from certkv.eval.decode import Method, Prefill
from certkv.eval.runner import _override
from certkv.eval.tasks import NeedleTask, PerplexityTask, RulerTask
from certkv.models import load_model

TINY = {"name": "tiny_random", "device": "cpu", "seed": 0,
        "random_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16,
                          "max_position_embeddings": 8192}}
METHODS = [Method.build("dense", "dense"), Method.build("naive", "naive"),
           Method.build("certified")]


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY)


def prompt(lm, n=300):
    return torch.randint(0, 500, (n,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture
def no_eos(lm, monkeypatch):
    """Greedy decoding never stops early (the decoder's and the native model's EOS ids off), so
    every requested token is compared."""
    monkeypatch.setattr(decode, "end_of_sequence_ids", lambda _: set())
    monkeypatch.setattr(lm.model.generation_config, "eos_token_id", None)


def native_greedy(lm, ids, steps):
    """The native model's greedy continuation of ``ids`` (its own cache and attention)."""
    out = lm.model.generate(torch.tensor([ids]), max_new_tokens=steps, do_sample=False)
    return out[0, len(ids):].tolist()


def test_dense_method_is_the_model_itself(lm, no_eos):
    """The dense baseline runs the model's own cache and SDPA: its greedy tokens are the
    native model's."""
    ids = prompt(lm)
    shared = Prefill(lm, ids[:-1])
    tokens = shared.session(METHODS[0]).decoder().generate(ids[-1], 12)
    assert len(tokens) == 12 and tokens == native_greedy(lm, ids, 12)


def test_every_method_decodes_from_the_shared_prefill(lm, no_eos):
    """Each decoder is a fresh copy of the shared prefill: what one is fed never reaches
    another (its tokens equal those of a decoder from a prefill of its own), and the dense
    method's tokens are the native model's on the same text."""
    ids = prompt(lm)
    shared = Prefill(lm, ids[:-1])
    for method in METHODS:
        session = shared.session(method)
        a, b = session.decoder(), session.decoder()  # two fresh copies
        a.feed(ids[-6:-1])
        out = a.generate(ids[-1], 4)
        copy = b.generate(ids[-1], 2)
        alone = Prefill(lm, ids[:-1]).session(method).decoder().generate(ids[-1], 2)
        assert len(out) == 4 and len(copy) == 2 and copy == alone, method.name
        if method.mode == "dense":
            assert out == native_greedy(lm, ids[:-1] + ids[-6:], 4)
            assert copy == native_greedy(lm, ids, 2)
        record = session.certificate_record()
        assert len(session.step_ms) == 6
        assert record["steps"] == (0 if method.mode == "dense" else 6)


def test_generation_stops_at_end_of_sequence(lm, monkeypatch):
    ids = prompt(lm)
    session = Prefill(lm, ids[:-1]).session(METHODS[2])
    first = session.decoder().generate(ids[-1], 3)
    monkeypatch.setattr(decode, "end_of_sequence_ids", lambda _: {first[0]})
    assert session.decoder().generate(ids[-1], 3) == []


def test_memory_stays_flat_over_many_samples(lm):
    """Nothing of a finished sample stays alive (no reference cycles): the number of live
    stores is the same after 1 and after 8 samples, without the cyclic collector."""

    gc.collect()
    gc.disable()
    try:
        counts = []
        for i in range(8):
            ids = prompt(lm, 100 + 10 * i)
            shared = Prefill(lm, ids[:-1])
            for method in METHODS:
                shared.session(method).decoder().generate(ids[-1], 2)
            del shared
            counts.append(live_stores())
        assert counts[0] == counts[-1] == 0
    finally:
        gc.enable()


def live_stores() -> int:
    return sum(type(o) is TieredKVStore for o in gc.get_objects())


def test_a_closed_decoder_frees_its_cache_and_keeps_its_telemetry(lm):
    """Ten questions of one document hold one copy at a time besides the prefill's quantized
    template (the ten-needle NIAH held ten until the sample ended: 10 GB at 4K on SmolLM2), and
    the record still counts them all."""
    ids = prompt(lm)
    session = Prefill(lm, ids[:-1]).session(METHODS[2])
    gc.collect()
    before = live_stores()
    for i in range(10):
        with session.decoder() as decoder:
            decoder.feed(ids[-5:-1])
            decoder.generate(ids[-1], 2)
        if i == 0:  # the quantized prefill, kept by the Prefill and copied per decoder
            template = live_stores() - before
            assert template == lm.num_layers
        assert decoder.cache is None and live_stores() == before + template
    record = session.certificate_record()
    assert record["steps"] == len(session.step_ms) > 0
    assert record["dense_bytes"] > 0 and 0 <= record["scratch_hit_rate"] <= 1
    with pytest.raises(CertKVError, match="decoder is closed"):
        decoder.step(ids[-1])


def test_ruler_task_on_a_tiny_model(lm, books):
    task = RulerTask(context=1024, slices=1)
    samples = task.samples(lm.tokenizer, lm.max_context)
    assert [s.meta["subtask"] for s in samples] == list(task.subtasks)
    assert all(900 < s.meta["context"] <= 1024 for s in samples)
    shared = Prefill(lm, samples[4].prefix)
    result = task.evaluate(shared.session(METHODS[2]), samples[4])
    answers, metric = samples[4].payload.answers, samples[4].payload.metric
    found = [a.lower() in result["generated"].lower() for a in answers]
    expected = sum(found) / len(found) if metric == "all" else float(any(found))
    assert result["answers"] == list(answers) and result["score"] == expected
    assert result["pass"] == (expected == 1.0)
    records = [{"subtask": s.meta["subtask"], "slice": 0, "score": float(i % 2)}
               for i, s in enumerate(samples)]
    agg = RulerTask.aggregate(records)
    assert agg["accuracy"] == pytest.approx(3 / 7) and agg["slices"] == 1
    with pytest.raises(CertKVError, match="unknown RULER subtasks"):
        RulerTask(subtasks=("niah_single", "qa_1"))


def test_ten_needle_niah_asks_every_needle_on_a_fresh_copy(lm, books):
    task = NeedleTask(context=1200, trials=1, max_new_tokens=4)
    sample = task.samples(lm.tokenizer, lm.max_context)[0]
    questions, answers = sample.payload
    assert len(questions) == len(answers) == 10
    assert sample.meta["context"] + task.max_new_tokens <= 1200
    session = Prefill(lm, sample.prefix).session(METHODS[2])
    result = task.evaluate(session, sample)
    assert len(session.decoders) == 10 and result["answers"] == list(answers)
    found = [float(a.lower() in g.lower()) for a, g in zip(answers, result["generated"],
                                                           strict=True)]
    assert result["retrieved"] == found and result["accuracy"] == sum(found) / 10
    assert result["pass"] == all(found)
    single = NeedleTask(context=600, trials=2, needles=1, max_new_tokens=3)
    one = single.samples(lm.tokenizer, lm.max_context)
    assert len(one) == 2 and one[0].payload is None and one[0].meta["needles"] == 1
    with pytest.raises(CertKVError, match="needles=3 is not supported"):
        NeedleTask(needles=3)


def test_perplexity_follows_the_pg19_protocol(lm, tmp_path):
    for name in ("a", "b"):
        (tmp_path / f"{name}.txt").write_text(" ".join(f"word{i}" for i in range(900)))
    task = PerplexityTask(corpus=str(tmp_path), context=256, windows=3)
    samples = task.samples(lm.tokenizer, lm.max_context)
    assert [s.meta["document"] for s in samples] == ["a", "b", "a"]
    assert all(len(s.prefix) + 1 + len(s.target) == 256 for s in samples)
    assert all(len(s.target) == 128 for s in samples)  # half the window through the method
    short = PerplexityTask(corpus=str(tmp_path), context=256, decode_tokens=8, windows=1)
    sample = short.samples(lm.tokenizer, lm.max_context)[0]
    result = short.evaluate(Prefill(lm, sample.prefix).session(METHODS[1]), sample)
    assert result["tokens"] == 8 and math.isfinite(result["ppl"])


def test_corpus_windows_and_errors(lm, tmp_path):
    (tmp_path / "short.txt").write_text("tiny")
    (tmp_path / "long.txt").write_text(" ".join(f"w{i}" for i in range(400)))
    windows = corpus_windows(lm.tokenizer, str(tmp_path), 100, 3)
    assert [d for d, _ in windows] == ["long"] * 3
    assert windows[0][1] != windows[1][1]  # consecutive, disjoint windows
    with pytest.raises(CertKVError, match="fewer than 500"):
        corpus_windows(lm.tokenizer, str(tmp_path), 100, 500)
    with pytest.raises(CertKVError, match="neither a book"):
        corpus_windows(lm.tokenizer, str(tmp_path / "nope"), 100, 1)
    with pytest.raises(CertKVError, match="corpus=books"):
        corpus_windows(lm.tokenizer, "pg19", 100, 1)  # offline in tests


def test_a_variant_node_with_another_target_replaces_the_default():
    base = {"_target_": "Q", "block_size": 16,
            "value_codec": {"_target_": "G", "bits": 4, "group": 16}}
    assert _override(base, {"value_codec": {"_target_": "F"}})["value_codec"] == {
        "_target_": "F"}
    assert _override(base, {"value_codec": {"bits": 2}})["value_codec"] == {
        "_target_": "G", "bits": 2, "group": 16}
