"""The ``certkv`` attention implementation for transformers models (PLATFORM: transformers 5).

Registered once under the name ``certkv`` (attention function and SDPA mask function). The
attention function receives, as ``key``, the :class:`StoreHandle` that ``TieredCache.update``
returned: prefill (``Tq > 1``) runs the model's own dense SDPA over the prompt; every decode step
(``Tq == 1``) runs :class:`CertifiedAttention` on the layer's store and logs the certificate.
With any other cache (or none) the model runs exactly as with ``attn_implementation="sdpa"``:
certification happens only where a :class:`~certkv.models.hf_cache.TieredCache` is passed.
"""

from __future__ import annotations

import functools
import inspect
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from certkv.errors import CertKVError, require
from certkv.models.tiered_layer import StoreHandle

NAME = "certkv"
_RECORDING: ContextVar[PromptQueries | None] = ContextVar("certkv_prompt_queries", default=None)


class PromptQueries(dict):
    """Layer index -> ``(queries [Hq, T, d], scaling)``: each layer's last ``last`` prompt
    queries (after RoPE) seen by :func:`certkv_attention` during a dense prefill on the model's
    own cache, for eviction policies that rank by them (SnapKV)."""

    def __init__(self, last: int) -> None:
        super().__init__()
        self.last = last


@contextmanager
def recording_prompt_queries(last: int):
    """Within the block, a prefill on the model's own cache records :class:`PromptQueries`
    (yielded; empty when ``last`` is 0)."""
    record = PromptQueries(last)
    token = _RECORDING.set(record if last > 0 else None)
    try:
        yield record
    finally:
        _RECORDING.reset(token)


def certkv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """``query [1, Hq, Tq, d]`` -> ``(out [1, Tq, Hq, d], None)``."""
    if not isinstance(key, StoreHandle):  # the model's own cache: plain SDPA
        record = _RECORDING.get()
        if record is not None and query.shape[2] > 1:
            record[module.layer_idx] = (query[0, :, -record.last:].detach().clone(), scaling)
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    layer = key.layer
    batch, hq, tq, d = query.shape
    if batch > 1:
        return _batched(module, query, key, attention_mask, scaling, dropout, **kwargs)
    if tq > 1:
        return _prefill(module, query, key, attention_mask, scaling, dropout, **kwargs)
    cache = layer.cache
    out, cert = cache.attention(query[0, :, 0, :], layer.store, scaling, scratch=layer.scratch)
    layer.record(cert)
    return out.view(1, 1, hq, d).to(query.dtype), None


def _prefill(module, query, handle: StoreHandle, attention_mask, scaling, dropout, **kwargs):
    """Dense SDPA over the cached FP16 originals plus the fresh prompt states (paper 8)."""
    new_k, new_v = handle.new_keys, handle.new_values
    store = handle.layer.store
    cached = store.num_tokens - new_k.shape[2]
    if cached:
        old_k, old_v = store.dense_kv()
        new_k = torch.cat([old_k[:, :cached].to(new_k.dtype)[None], new_k], dim=2)
        new_v = torch.cat([old_v[:, :cached].to(new_v.dtype)[None], new_v], dim=2)
    out = sdpa_attention_forward(module, query, new_k, new_v, attention_mask, dropout=dropout,
                                 scaling=scaling, **kwargs)
    store.observe_prompt(query[0].detach(), scaling)  # SnapKV ranks by the prompt's queries
    return out


def _batched(module, query, handle: StoreHandle, attention_mask, scaling, dropout, **kwargs):
    """A batch's step (``query [B, Hq, Tq, d]``): each sequence's real tokens (the mask's, left
    padding) appended to its own store, then the prompt's dense SDPA over the padded batch
    (the model's own computation) or one certified step per sequence
    (:meth:`~certkv.attention.CertifiedAttention.batch`)."""
    layer, new_k, new_v = handle.layer, handle.new_keys, handle.new_values
    batch, hq, tq, d = query.shape
    capturing = layer.cache.captured is not None  # a graph's step reads no host value
    real = None if capturing else _real_tokens(attention_mask, batch, tq, query.device)
    require(tq == 1 or not any(store.num_tokens for store in layer.stores), CertKVError,
            "a batch is prefilled in one call (generate() does); a second prompt chunk for a "
            "batch is not supported: pass each prompt whole.")
    if tq == 1:  # a decode step: each sequence's one token (a step of padding is refused)
        for b in range(batch):
            layer.append(b, new_k[b], new_v[b])
        out, certs = layer.cache.attention.batch(query[:, :, 0, :], layer.stores, scaling,
                                                 scratches=layer.scratches)
        layer.record_batch(certs)
        return out.view(batch, 1, hq, d).to(query.dtype), None
    for b, store in enumerate(layer.stores):  # the prompts, their padding left out
        keep = real[b]
        store.append(new_k[b][:, keep], new_v[b][:, keep])
        store.observe_prompt(query[b][:, keep].detach(), scaling)  # SnapKV's queries
    return sdpa_attention_forward(module, query, new_k, new_v, attention_mask, dropout=dropout,
                                  scaling=scaling, **kwargs)


def _real_tokens(attention_mask, batch: int, tq: int, device) -> torch.Tensor:
    """bool ``[B, Tq]``: which of the step's new positions are tokens, not padding, read from
    the mask's last query row (every real key up to it is visible there). Padding must be on
    the left: a real token before a padded one, or a step of only padding, is refused."""
    if attention_mask is None:
        return torch.ones(batch, tq, dtype=torch.bool, device=device)
    row = attention_mask[:, 0, -1, -tq:]
    real = row if row.dtype == torch.bool else row > torch.finfo(row.dtype).min
    real = real.expand(batch, tq)
    left = (real.int().diff(dim=-1) >= 0).all() if tq > 1 else True
    require(bool(left) and bool(real.any(dim=-1).all()), CertKVError,
            "a batch must be padded on the left (tokenizer.padding_side = 'left') with at least "
            "one token per sequence; right padding would put padding inside a sequence.")
    return real


def register() -> str:
    """Register the ``certkv`` attention and mask functions (idempotent); returns the name."""
    AttentionInterface.register(NAME, certkv_attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    return NAME


def enable(model) -> None:
    """Switch ``model`` to the certkv attention (register first if needed)."""
    model.set_attn_implementation(register())


def cache_kwargs(model, cache) -> dict:
    """The keyword that passes ``cache`` to ``model``'s forward: ``cache`` from transformers 5.24
    (where ``past_key_values`` is deprecated and warns), ``past_key_values`` before it."""
    return {_cache_keyword(type(model)): cache}


@functools.cache
def _cache_keyword(model_class: type) -> str:
    """The cache keyword of ``model_class.forward``, read once per class (a decode step asks for
    it every token)."""
    forward = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in forward else "past_key_values"
