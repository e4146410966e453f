"""TieredCache + the certkv attention inside transformers models (Llama, Mistral, Qwen2)."""

from __future__ import annotations

import inspect
import os
import warnings

import pytest
import torch
from helpers import make_kv
from helpers.models import ContractChecker, left_padded, tiny_model
from transformers import DynamicCache

from certkv import AdaptiveTopK, CertifiedAttention, Ladder, LocalThreshold
from certkv.errors import CertKVError
from certkv.models import cache_kwargs
from certkv.models.hf_cache import CacheSpec, TieredCache


def prompt(n=40, seed=0):
    return torch.randint(0, 512, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_generate_with_every_mode(model_type):
    native, model = tiny_model(model_type)
    ids = prompt()
    ref = native.generate(ids, max_new_tokens=12, do_sample=False)
    for mode in ("dense", "naive", "certified"):
        attn = ContractChecker(CertifiedAttention(mode=mode))
        cache = TieredCache(model.config.num_hidden_layers, attn)
        out = model.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
        cache.log.flush()
        assert out.shape == ref.shape
        assert len(cache.log.steps) == 11  # the first new token comes from prefill
        assert all(s["layers"] == 2 and s["heads"] == 8 for s in cache.log.steps)
        assert attn.head_steps == 11 * 2 * 4
        if mode == "dense":  # FP16 KV vs the model's FP32 KV: same greedy tokens here
            assert torch.equal(out, ref)


@pytest.mark.parametrize(("backend", "mode", "kept"), [
    ("numba", "certified", ("bound", "bias")), ("torch", "naive", ("k", "v", "bound",
                                                                         "orig_k", "bias")),
    ("numba", "dense", ())])
def test_the_stores_keep_the_mirror_their_attention_reads(backend, mode, kept):
    """On a CPU a model's stores keep what their attention reads decoded
    (:meth:`CertifiedAttention.decoded_mirror`): a lean mirror for the numba loops, the whole
    one for the PyTorch reference, none in dense mode."""
    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention(backend=backend, mode=mode))
    out = model.generate(prompt(), max_new_tokens=4, do_sample=False,
                         **cache_kwargs(model, cache))
    assert out.shape[1] == 44
    assert all(store._mirror_fields == kept for store in cache.stores())


def test_cache_kwargs_names_the_argument_this_transformers_takes_without_a_warning():
    """transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns):
    ``cache_kwargs`` passes whichever the installed version's forward declares."""
    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention())
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = model.generate(prompt(), max_new_tokens=3, do_sample=False,
                             **cache_kwargs(model, cache))
    cache.log.flush()
    assert out.shape[1] == 43 and len(cache.log.steps) == 2
    (name,) = cache_kwargs(model, cache)
    assert name in inspect.signature(model.forward).parameters


def test_model_loop_equals_generate_and_matches_native_logits():
    native, model = tiny_model()
    ids = prompt()
    cache = TieredCache(2, CertifiedAttention(mode="dense"))
    dyn = DynamicCache()
    with torch.no_grad():
        logits = model(ids, past_key_values=cache).logits[:, -1]
        ref = native(ids, past_key_values=dyn).logits[:, -1]
        torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5)  # prefill is dense SDPA
        tokens = []
        for _ in range(6):
            nxt = logits.argmax(-1, keepdim=True)
            tokens.append(int(nxt))
            logits = model(nxt, past_key_values=cache).logits[:, -1]
            ref = native(nxt, past_key_values=dyn).logits[:, -1]
            torch.testing.assert_close(logits, ref, rtol=2e-3, atol=2e-3)  # FP16 KV rounding
    gen = model.generate(ids, max_new_tokens=6, do_sample=False,
                         past_key_values=TieredCache(2, CertifiedAttention(mode="dense")))
    assert gen[0, ids.shape[1]:].tolist() == tokens


@pytest.mark.parametrize("quantizer", [None, "tiers"])
def test_a_prompt_prefilled_under_inference_mode_decodes_under_no_grad(quantizer):
    """A cache filled under ``torch.inference_mode()`` (its stores then hold inference tensors,
    which PyTorch lets nothing update in place outside that mode) serves ``generate()``, which
    runs under ``no_grad``: the same tokens and certificates as a run kept in inference mode
    (the tiers also move blocks between precisions in place as they age)."""
    from certkv.quant import GroupAffineValueCodec, KiviKeyCodec, Precision, TieredQuantizer
    from certkv.quant.tiers import ARCHIVES

    def tiers():  # hot 16 tokens, warm 4-bit to 48, then a 2-bit archive (head_dim 16)
        archive = Precision(KiviKeyCodec(bits=2), GroupAffineValueCodec(bits=2, group=16))
        return TieredQuantizer(KiviKeyCodec(bits=4), GroupAffineValueCodec(bits=4, group=16), 8,
                               hot=16, stale=48, archive="kivi2",
                               archives=dict.fromkeys(ARCHIVES, archive))

    _, model = tiny_model(seed=1)
    ids = prompt(70, seed=1)
    runs = []
    for inside in (True, False):
        cache = TieredCache(2, CertifiedAttention(), None if quantizer is None else tiers())
        with torch.inference_mode():
            model(ids[:, :-1], past_key_values=cache)
        with torch.inference_mode(inside):
            out = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=cache)
        cache.log.flush()
        runs.append((out, cache.log.steps))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]


def test_full_promotion_equals_dense():
    _, model = tiny_model(seed=3)
    ids = prompt(70, seed=3)
    full = CertifiedAttention(selector=AdaptiveTopK(tau_cov=1.0, k_min=0, k_max=10_000),
                              value_policy=LocalThreshold(v_tol=0.0))
    outs, logits = [], []
    for attn in (CertifiedAttention(mode="dense"), full):
        cache = TieredCache(2, attn)
        out = model.generate(ids, max_new_tokens=16, do_sample=False, past_key_values=cache,
                             output_logits=True, return_dict_in_generate=True)
        outs.append(out.sequences)
        logits.append(torch.stack(out.logits))
    assert torch.equal(outs[0], outs[1])
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)


def test_chunked_prefill_reads_cached_originals():
    _, model = tiny_model()
    ids = prompt(50)
    with torch.no_grad():
        whole = model(ids, past_key_values=TieredCache(2, CertifiedAttention())).logits[:, -1]
        cache = TieredCache(2, CertifiedAttention())
        model(ids[:, :30], past_key_values=cache)
        chunked = model(ids[:, 30:], past_key_values=cache).logits[:, -1]
    torch.testing.assert_close(whole, chunked, rtol=2e-3, atol=2e-3)
    assert cache.get_seq_length() == 50


def test_full_records_and_scratch_statistics():
    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention(), spec=CacheSpec(records="full",
                                                               scratch_key_blocks=64))
    model.generate(prompt(64), max_new_tokens=5, do_sample=False, past_key_values=cache)
    cache.log.flush()
    assert len(cache.log.heads) == 4 * 2 * 4  # steps x layers x heads
    assert {"step", "layer", "head", "e_key", "rung"} <= set(cache.log.heads[0])
    stats = cache.scratch_stats()
    assert stats.hits > 0 and stats.misses > 0 and stats.h2d_bytes > 0
    sizes = cache.bytes()
    assert sizes["tier2"] == sizes["dense"] - sizes["tail"]


def test_a_model_on_the_triton_backend_decodes_without_host_reads_like_the_host_path():
    """Issue 24 inside a model (the interpreter here, CUDA's path): generate() with page-in and
    rungs 3-4 on the device gives the host-read path's tokens and certificates, with full
    records and scratch statistics, and the contract on every head."""
    _, model = tiny_model()
    ids = prompt(64)
    runs = []
    for device_fallback in (True, False):
        attn = ContractChecker(CertifiedAttention(backend="triton",
                                                  device_fallback=device_fallback))
        cache = TieredCache(2, attn, spec=CacheSpec(records="full", scratch_key_blocks=4,
                                                    scratch_value_blocks=4))
        out = model.generate(ids, max_new_tokens=4, do_sample=False,
                             **cache_kwargs(model, cache))
        cache.log.flush()
        runs.append((out, cache.log.steps, cache.scratch_stats(), len(cache.log.heads)))
    (out_d, steps_d, stats_d, heads_d), (out_h, steps_h, stats_h, heads_h) = runs
    assert torch.equal(out_d, out_h) and heads_d == heads_h == 3 * 2 * 4
    for a, b in zip(steps_d, steps_h, strict=True):
        assert a["value_promotions"] == b["value_promotions"]
        assert (a["rung3"], a["rung4"]) == (b["rung3"], b["rung4"])
    assert stats_d == stats_h and stats_d.misses > 0


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_a_left_padded_batch_generates_what_each_prompt_generates_alone(model_type):
    """Issue 54: ``generate()`` on prompts of 23, 40 and 57 tokens padded on the left gives each
    the greedy tokens it gets alone, every (sequence, head) of every step within its bound of
    FP64 attention on its own tokens; the stores hold no padding, and each sequence has its own
    certificate log."""
    _, model = tiny_model(model_type)
    prompts = [prompt(n, seed=n)[0] for n in (40, 23, 57)]
    ids, mask = left_padded(prompts)
    checker = ContractChecker(CertifiedAttention())
    cache = TieredCache(2, checker)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                         pad_token_id=0, **cache_kwargs(model, cache))
    for b, p in enumerate(prompts):
        alone = model.generate(p[None], max_new_tokens=8, do_sample=False, pad_token_id=0,
                               **cache_kwargs(model, TieredCache(2, CertifiedAttention())))
        assert torch.equal(out[b, ids.shape[1]:], alone[0, len(p):]), b
    assert [s.num_tokens for s in cache.layers[0].stores] == [len(p) + 7 for p in prompts]
    assert checker.head_steps == 7 * 2 * 3 * 4  # steps x layers x sequences x heads
    cache.telemetry()
    logs = cache.sequence_logs(3)
    assert all(len(log.steps) == 7 for log in logs) and len(cache.log.steps) == 7
    assert cache.log.steps[0]["heads"] == 3 * 2 * 4


def test_num_return_sequences_samples_a_batch_of_independent_sequences():
    _, model = tiny_model()
    cache = TieredCache(2, ContractChecker(CertifiedAttention()))
    torch.manual_seed(0)
    out = model.generate(prompt(), max_new_tokens=6, do_sample=True, num_return_sequences=3,
                         pad_token_id=0, **cache_kwargs(model, cache))
    assert out.shape == (3, 46)
    assert len(cache.layers[0].stores) == 3 and cache.layers[0].stores[0].num_tokens == 45


def forced_log_prob(model, seq: torch.Tensor, start: int) -> float:
    """The summed log-probabilities of ``seq[start:]`` given what comes before it, decoded
    alone through a fresh :class:`TieredCache` (prompt prefilled, then one token a step)."""
    cache, total = TieredCache(2, CertifiedAttention()), 0.0
    with torch.no_grad():
        logits = model(seq[None, :start], **cache_kwargs(model, cache)).logits[0, -1]
        for t in range(start, len(seq)):
            total += torch.log_softmax(logits.double(), -1)[seq[t]].item()
            if t + 1 < len(seq):
                logits = model(seq[None, t:t + 1], **cache_kwargs(model, cache)).logits[0, -1]
    return total


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2"])
def test_beam_search_scores_every_beam_as_its_own_sequence_decoded_alone(model_type):
    """Beam search reorders the batch at every step: each returned beam's score (its tokens'
    summed log-probabilities, ``length_penalty=0``) must be what its own sequence gets decoded
    alone, which a beam reading another beam's cache would not give; every head keeps the
    contract meanwhile (ContractChecker: each beam's oracle is its own copy of the data)."""
    _, model = tiny_model(model_type)
    checker = ContractChecker(CertifiedAttention())
    cache = TieredCache(2, checker)
    ids = prompt(40)
    out = model.generate(ids, max_new_tokens=6, num_beams=3, num_return_sequences=3,
                         do_sample=False, length_penalty=0.0, early_stopping=True,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0,
                         **cache_kwargs(model, cache))
    assert len({tuple(s.tolist()) for s in out.sequences}) == 3  # three different beams
    for seq, score in zip(out.sequences, out.sequences_scores, strict=True):
        assert forced_log_prob(model, seq, 40) == pytest.approx(score.item(), abs=1e-4)
    assert checker.head_steps == 5 * 2 * 3 * 4  # steps x layers x beams x heads
    assert [s.num_tokens for s in cache.layers[0].stores] == [45] * 3
    cache.telemetry()  # closes the last step
    assert [len(log.steps) for log in cache.sequence_logs(3)] == [5] * 3


def test_beam_search_over_a_left_padded_batch_scores_each_beam_as_its_prompt_alone():
    """Two prompts of different lengths, left-padded, three beams each: every returned beam
    scores what its own prompt and tokens score decoded alone (padding never enters a beam's
    cache, and beams of one prompt never read another's)."""
    _, model = tiny_model()
    prompts = [prompt(n, seed=n)[0] for n in (40, 23)]
    ids, mask = left_padded(prompts)
    cache = TieredCache(2, ContractChecker(CertifiedAttention()))
    out = model.generate(ids, attention_mask=mask, max_new_tokens=5, num_beams=3,
                         num_return_sequences=2, do_sample=False, length_penalty=0.0,
                         early_stopping=True, output_scores=True, return_dict_in_generate=True,
                         pad_token_id=0, **cache_kwargs(model, cache))
    width = ids.shape[1]
    for i, (seq, score) in enumerate(zip(out.sequences, out.sequences_scores, strict=True)):
        own = prompts[i // 2]
        alone = forced_log_prob(model, torch.cat([own, seq[width:]]), len(own))
        assert alone == pytest.approx(score.item(), abs=1e-4), i
    assert [s.num_tokens for s in cache.layers[0].stores] == [44] * 3 + [27] * 3


def test_a_reorder_moves_each_chosen_sequence_and_copies_one_chosen_twice():
    """``reorder_cache([2, 0, 0])``: beam 0 takes sequence 2's store itself, beam 1 sequence
    0's, beam 2 an independent copy of it (what is appended to one is not in the other);
    sequence 1 leaves; the sequences' logs follow their beams."""
    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention())
    ids, mask = left_padded([prompt(n, seed=n)[0] for n in (40, 23, 57)])
    with torch.no_grad():
        out = model(ids, attention_mask=mask, **cache_kwargs(model, cache))
        step = torch.cat([mask, torch.ones(3, 1, dtype=mask.dtype)], dim=1)
        model(out.logits[:, -1:].argmax(-1), attention_mask=step, **cache_kwargs(model, cache))
    cache.telemetry()  # closes the step
    layer, logs = cache.layers[0], cache.sequence_logs(3)
    assert [len(log.steps) for log in logs] == [1] * 3
    before = list(layer.stores)
    cache.reorder_cache(torch.tensor([2, 0, 0]))
    after = layer.stores
    assert after[0] is before[2] and after[1] is before[0] and after[2] is not before[0]
    assert all(torch.equal(a, b) for a, b in zip(after[2].dense_kv(), before[0].dense_kv(),
                                                 strict=True))
    k, v = make_kv(after[2].num_kv_heads, 1, after[2].head_dim, seed=5)
    after[2].append(k, v)
    assert after[2].num_tokens == after[1].num_tokens + 1
    new_logs = cache.sequence_logs(3)
    assert new_logs[0] is logs[2] and new_logs[1] is logs[0] and new_logs[2] is not logs[0]
    assert new_logs[2].steps == logs[0].steps and new_logs[2].steps is not logs[0].steps


def test_a_batch_padded_on_the_right_is_refused_naming_the_fix():
    _, model = tiny_model()
    ids, mask = left_padded([prompt(30)[0], prompt(20)[0]])
    ids, mask = ids.flip(1), mask.flip(1)  # padding now on the right
    with pytest.raises(CertKVError, match=r"padded on the left \(tokenizer.padding_side = "), \
            torch.no_grad():
        model(ids, attention_mask=mask, past_key_values=TieredCache(2, CertifiedAttention()))


def test_a_batch_too_large_for_memory_is_refused_before_it_allocates(monkeypatch):
    from certkv.models import hf_cache

    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention())
    monkeypatch.setattr(hf_cache, "free_memory", lambda device: 10_000)
    with pytest.raises(CertKVError, match=r"^a batch of 4 prompts needs about .* GiB for its "
                                          r"caches but .* decode a smaller batch"), \
            torch.no_grad():
        model(prompt().repeat(4, 1), past_key_values=cache)
    assert cache.stores() == []  # nothing was allocated


def test_free_memory_counts_what_the_host_could_hand_out():
    from certkv.models.hf_cache import free_memory

    free = free_memory(torch.device("cpu"))
    assert free is None or 0 < free <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def test_a_batch_cache_refuses_the_one_sequence_store_view_naming_the_fix():
    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention())
    with torch.no_grad():
        model(prompt().repeat(2, 1), past_key_values=cache)
    with pytest.raises(CertKVError, match=r"use layer\.stores"):
        _ = cache.layers[0].store


def test_without_a_tiered_cache_the_model_runs_its_own_sdpa():
    native, model = tiny_model()
    ids = prompt()
    with torch.no_grad():
        for cache in (None, DynamicCache()):
            torch.testing.assert_close(model(ids, past_key_values=cache).logits,
                                       native(ids).logits, rtol=0, atol=0)


def _adaptive_quantizer(kind: str):
    from certkv.evict import HeavyHitterEviction, SnapKVEviction
    from certkv.quant import KVQuantizer, SmartKVQuantizer

    return {"default": None, "smartkv": SmartKVQuantizer(block_size=8, beta=0.3),
            "heavy_hitter": KVQuantizer().with_eviction(HeavyHitterEviction(budget=0.6, recent=16)),
            "snapkv": KVQuantizer().with_eviction(SnapKVEviction(budget=0.6, window=16))}[kind]


@pytest.mark.parametrize("kind", ["default", "smartkv", "heavy_hitter", "snapkv"])
def test_a_dropped_cache_is_freed_at_once(kind):
    """No reference cycle between a TieredCache, its layers and what adapts their stores
    (SmartKV's widths, eviction): dropping the last reference frees the stores without waiting
    for the cyclic garbage collector (a long run's memory stays flat)."""
    import gc
    import weakref

    _, model = tiny_model()
    cache = TieredCache(2, CertifiedAttention(), _adaptive_quantizer(kind))
    model.generate(prompt(120), max_new_tokens=3, do_sample=False, past_key_values=cache)
    store = weakref.ref(cache.layers[0].store)
    gc.disable()
    try:
        del cache
        assert store() is None
    finally:
        gc.enable()


def test_ladder_config_reaches_the_model():
    _, model = tiny_model(seed=1)
    attn = CertifiedAttention(selector=AdaptiveTopK(k_min=0, k_max=1),
                              ladder=Ladder(expand=False))
    cache = TieredCache(2, attn)
    model.generate(prompt(80), max_new_tokens=3, do_sample=False, past_key_values=cache)
    cache.log.flush()
    assert all(s["k_star_mean"] <= 1.0 for s in cache.log.steps)


def test_copy_for_gives_independent_stores_with_the_same_quantized_prefill():
    states = [make_kv(2, 40, 16, seed=s) for s in range(2)]
    template = TieredCache.from_states(states, CertifiedAttention())
    copy = template.copy_for(CertifiedAttention(mode="naive"))
    assert copy.attention.mode == "naive" and copy.log is not template.log
    for a, b in zip(template.stores(), copy.stores(), strict=True):
        assert a is not b and a.num_tokens == b.num_tokens == 40
        assert torch.equal(a.key_blocks()["codes"], b.key_blocks()["codes"])
        assert torch.equal(a.annotation("value_spec"), b.annotation("value_spec"))
    k, v = make_kv(2, 1, 16, seed=9)
    copy.layers[0].update(k[None], v[None])
    assert copy.stores()[0].num_tokens == 41 and template.stores()[0].num_tokens == 40


@pytest.mark.parametrize("rule", ["importance", "certificate"])
def test_smartkv_inside_a_model_shares_widths_across_layers(rule):
    """Every decode step certified against FP64; the layers of one cache reallocate together
    (cross-layer importance, the same widths per block), and a copy of the quantized prefill
    gets its own board."""
    from certkv.quant import SmartKVQuantizer

    _, model = tiny_model()
    quantizer = SmartKVQuantizer(block_size=8, beta=0.3, rule=rule)
    attn = ContractChecker(CertifiedAttention())
    template = TieredCache(model.config.num_hidden_layers, attn, quantizer)
    with torch.no_grad():
        model(prompt(120), past_key_values=template, use_cache=True)
        cache = template.copy_for(attn)
        assert cache.board is not template.board
        ids = prompt(1, seed=3)
        for _ in range(40):
            logits = model(ids, past_key_values=cache, use_cache=True).logits
            ids = logits[:, -1:].argmax(dim=-1)
    first, second = cache.stores()
    assert torch.equal(first.block_precision, second.block_precision)
    assert first._tracker.reallocations >= 2 and len(first.block_precision.unique()) > 1
    assert template.stores()[0]._tracker.reallocations == 1  # the prefill's only


def test_innerq_inside_a_model_is_certified():
    from certkv.quant import InnerQKeyCodec, InnerQValueCodec, KVQuantizer

    _, model = tiny_model()
    quantizer = KVQuantizer(InnerQKeyCodec(bits=2, group=16), InnerQValueCodec(bits=2), 16,
                            residual=16, sink=16)
    attn = ContractChecker(CertifiedAttention())
    cache = TieredCache(model.config.num_hidden_layers, attn, quantizer)
    model.generate(prompt(100), max_new_tokens=10, do_sample=False, past_key_values=cache)
    assert attn.head_steps == 9 * 2 * 4 and cache.stores()[0].num_quantized() > 0
