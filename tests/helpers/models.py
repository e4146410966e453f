"""Small random LLaMA-family models for integration tests (no download, seconds to build)."""

from __future__ import annotations

import copy
from typing import NamedTuple

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from certkv import CertifiedAttention
from certkv.models import cache_kwargs, enable
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


class BatchDecode(NamedTuple):
    """What :func:`decode_a_batch` returns."""

    logits: list  # [B, V] per step (B shrinks when a sequence leaves)
    logs: list  # each sequence's step log
    decode: object  # the GraphedDecode, or None
    length: int  # the batch cache's get_seq_length() at the end


def decode_a_batch(model, attention, graphed: bool = False, graph=None, steps: int = 10,
                   leave_at: int = 6, lengths=(9, 12, 5), device: str = "cpu") -> BatchDecode:
    """Greedy decoding of a batch: prompts of ``lengths`` tokens, each prefilled alone into its
    own cache (``attention``, padded layouts, deferred commits, as a graphed decode has them),
    joined (:meth:`TieredCache.batch_of`) and decoded ``steps`` tokens at each sequence's own
    positions, the second sequence leaving at step ``leave_at``; ``graphed``: through
    :class:`~certkv.graphs.GraphedDecode` with the graph class ``graph`` (None: CUDA graphs),
    else the model's eager forward."""
    from certkv.graphs import GraphedDecode
    from certkv.models.hf_cache import CacheSpec, TieredCache
    from certkv.quant import KVQuantizer

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (1, n), generator=gen).to(device) for n in lengths]
    attention.pad_layout = True  # as the graphed decode pads the layouts
    caches = []
    with torch.inference_mode():
        for ids in prompts:
            cache = TieredCache(len(model.model.layers), attention, KVQuantizer(block_size=4),
                                CacheSpec(scratch_key_blocks=4, scratch_value_blocks=4))
            cache.defer_commit = True  # as GraphedDecode sets it
            model(input_ids=ids, **cache_kwargs(model, cache))
            caches.append(cache)
        batch = TieredCache.batch_of(caches)
        decode = GraphedDecode(model, batch, graph) if graphed else None
        positions = torch.tensor(lengths, device=device)
        tokens = torch.tensor([[3 + 2 * b] for b in range(len(lengths))], device=device)
        logits = []
        for step in range(steps):
            if step == leave_at:  # the second sequence finishes and leaves
                rows = torch.tensor([b for b in range(len(lengths)) if b != 1], device=device)
                batch.batch_select_indices(rows)
                positions, tokens = positions[rows], tokens[rows]
            if decode is None:
                out = model(input_ids=tokens, position_ids=positions[:, None],
                            **cache_kwargs(model, batch)).logits
            else:
                out = decode(tokens, positions)
            logits.append(out[:, -1])
            tokens, positions = out[:, -1:].argmax(dim=-1), positions + 1
    for cache in caches:
        cache.log.flush()
    return BatchDecode(logits, [cache.log.steps for cache in caches], decode,
                       batch.get_seq_length())
