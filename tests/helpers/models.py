"""Small random LLaMA-family models for integration tests (no download, seconds to build)."""

from __future__ import annotations

import copy

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from certkv import CertifiedAttention
from certkv.models import enable
from helpers import check_heads

SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "max_position_embeddings": 2048, "vocab_size": 512}


def tiny_model(model_type: str = "llama", seed: int = 0, peaked: float = 4.0):
    """A random model of ``model_type`` with q/k projections scaled up so attention is peaked
    (random-init attention is nearly uniform, PLATFORM.md); returns (native sdpa, certkv copy)."""
    config = AutoConfig.for_model(model_type, **SMALL)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(peaked)
            layer.self_attn.k_proj.weight.mul_(peaked)
    certkv_model = copy.deepcopy(model)
    enable(certkv_model)
    return model, certkv_model


def greedy_decode(model, cache, ids: torch.Tensor, steps: int, decode=None) -> torch.Tensor:
    """Prefill ``ids[:, :-1]`` into ``cache``, then decode ``steps`` greedy tokens from the
    last one with ``decode(token [1, 1]) -> logits [1, 1, V]`` (default: the model's forward
    with the cache); returns every step's logits ``[steps, 1, V]``. The cache's log is flushed."""
    from certkv.models import cache_kwargs

    kwargs = cache_kwargs(model, cache)
    if decode is None:
        def decode(token):
            return model(input_ids=token, **kwargs).logits
    logits, token = [], ids[:, -1:]
    with torch.inference_mode():
        model(input_ids=ids[:, :-1], **kwargs)
        for _ in range(steps):
            logits.append(decode(token))
            token = logits[-1][:, -1:].argmax(dim=-1)
    cache.log.flush()
    return torch.cat(logits)


class ContractChecker:
    """Wraps a CertifiedAttention and checks every head of every call against FP64
    (:func:`helpers.check_heads`: no allowance beyond the reference's own rounding)."""

    def __init__(self, inner: CertifiedAttention) -> None:
        self.inner = inner
        self.head_steps = 0

    @property
    def mode(self) -> str:
        return self.inner.mode

    def decoded_mirror(self, device):
        return self.inner.decoded_mirror(device)

    def __call__(self, q, store, scaling=None, scratch=None):
        out, cert = self.inner(q, store, scaling, scratch=scratch)
        check_heads(out, cert, q, store, scaling)
        self.head_steps += q.shape[0]
        return out, cert

    def batch(self, q, stores, scaling=None, scratches=None):
        """A batch step, every (sequence, head) checked against FP64 on that sequence's own
        originals."""
        out, certs = self.inner.batch(q, stores, scaling, scratches)
        for b, (store, cert) in enumerate(zip(stores, certs, strict=True)):
            assert cert.sequence == b
            check_heads(out[b], cert, q[b], store, scaling)
            self.head_steps += q.shape[1]
        return out, certs


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [B, L], attention_mask [B, L])`` of 1-D ``prompts`` padded on the left with
    ``pad`` to the longest, as a tokenizer with ``padding_side='left'`` gives them."""
    longest = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), longest), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, longest - len(p):] = p
        mask[b, longest - len(p):] = 1
    return ids, mask
