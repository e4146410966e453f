"""A method's requests decoded in batches: the evaluation protocol (:mod:`certkv.eval.decode`)
for many prompts at once.

A :class:`Request` is one question to a method: its session's dense prefill, prompt tokens fed
after it (a NIAH question), then greedy generation or teacher-forced scoring. Each request is
prepared alone, exactly as at batch 1 (its own copy of the prefill, its feed); then the decode
steps of up to ``batch_size`` requests run as one forward pass of the model
(:class:`BatchDecoder`): one store per sequence behind
:meth:`~certkv.attention.CertifiedAttention.batch` for naive and certified methods, the model's
own cache left-padded for dense. A finished request leaves the batch and the others go on,
nothing copied::

    answers = answer_all([Request(session, first=ids[-1], max_new_tokens=16)
                          for session, ids in prompts], batch_size=8)

A batch gives every request the answer it gets alone, with one difference in the last bits: each
sequence's attention and certificate are the same computation at any batch size, but the
model's matrix products over a batch of rows sum in another order than over one row, so logits
differ by about 1e-5 (greedy tokens change only at a near-tie). Every certificate holds either
way: it bounds the attention of the queries it was given.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from certkv.eval.decode import Decoder, Session, _sync, end_of_sequence_ids
from certkv.eval.hf_quantized import joinable
from certkv.graphs import GraphedDecode
from certkv.models.hf_cache import TieredCache
from certkv.models.hook import cache_kwargs


@dataclass
class Request:
    """One question to a method (``session``): ``feed`` prompt tokens after the session's
    prefill, then from ``first`` either greedy generation of at most ``max_new_tokens``
    tokens (stopping at end-of-sequence, or once ``stop(tokens)`` says so) or, with
    ``target``, teacher-forced scoring of those tokens."""

    session: Session
    first: int
    feed: list[int] = field(default_factory=list)
    max_new_tokens: int = 0
    target: list[int] = field(default_factory=list)
    stop: Callable[[list[int]], bool] | None = None


@dataclass
class Answer:
    """A request's result: the generated tokens (end-of-sequence left out) or, when scored,
    each target token's log-probability (FP32 log-softmax) and whether every target token was
    the greedy choice; ``batch``: how many requests were decoded together."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    greedy: bool = True
    batch: int = 1  # the requests its decode steps started with (itself included)


class _Answering:
    """One request's progress through its decode steps."""

    def __init__(self, request: Request, stop_ids: set[int]) -> None:
        self.request, self.stop_ids = request, stop_ids
        self.next, self.answer = request.first, Answer()

    def take(self, logits: torch.Tensor) -> bool:
        """Use one step's FP32 logits ``[vocab]``; whether the request needs another step."""
        request, answer = self.request, self.answer
        if request.target:
            target = request.target[len(answer.logprobs)]
            logp = torch.log_softmax(logits, dim=-1)
            answer.logprobs.append(float(logp[target]))
            answer.greedy = answer.greedy and int(logp.argmax()) == target
            self.next = target
            return len(answer.logprobs) < len(request.target)
        token = int(logits.argmax())
        if token in self.stop_ids:
            return False
        answer.tokens.append(token)
        self.next = token
        stop = request.stop is not None and request.stop(answer.tokens)
        return len(answer.tokens) < request.max_new_tokens and not stop


def answer_all(requests: list[Request], batch_size: int = 1) -> list[Answer]:
    """Every request's :class:`Answer`, in order, decoding ``batch_size`` requests at a time
    (each prepared alone, its decode steps batched; its decoder closed at the end, keeping its
    session's telemetry)."""
    answers = []
    for start in range(0, len(requests), batch_size):
        answers += _answer_batch(requests[start : start + batch_size])
    return answers


def _answer_batch(requests: list[Request]) -> list[Answer]:
    """The answers of requests decoded together (module docstring)."""
    if not requests:
        return []
    stop_ids = end_of_sequence_ids(requests[0].session.prefill.lm)
    answering = [_Answering(r, stop_ids) for r in requests]
    decoders = []
    for request in requests:
        decoder = request.session.decoder()
        decoder.feed(request.feed)
        decoders.append(decoder)
    active = [i for i, r in enumerate(requests) if r.target or r.max_new_tokens > 0]
    # a request with nothing cached yet (a one-token context) has no store to join, and a
    # quantized HF cache no way to join: alone
    alone = [i for i in active if decoders[i].cache.get_seq_length() == 0
             or not joinable(decoders[i].cache)]
    for group in [[i for i in active if i not in alone], *([i] for i in alone)]:
        for i in group:
            answering[i].answer.batch = len(group)
        _decode([answering[i] for i in group], [decoders[i] for i in group])
    for decoder in decoders:
        decoder.close()
    return [a.answer for a in answering]


def _decode(answering: list[_Answering], decoders: list[Decoder]) -> None:
    """Step ``decoders`` together until every request in ``answering`` has its answer."""
    with BatchDecoder(decoders) as batch:
        while answering:
            logits = batch.step([a.next for a in answering])
            going = [row for row, a in enumerate(answering) if a.take(logits[row])]
            if len(going) < len(answering):
                batch.keep(going)
                answering = [answering[row] for row in going]


class BatchDecoder:
    """Decode steps of prepared :class:`Decoder` objects (one method, a cache each) as one
    forward pass: their caches joined into one batch (:meth:`TieredCache.batch_of`, or the
    model's own caches left-padded), each sequence at its own positions. A batch of one is
    its decoder's own step; a method with graphs captures the batch's whole steps
    (:class:`~certkv.graphs.GraphedDecode`, a bucket per set of sequences). Each step's time
    goes to every decoder in the batch (its ``step_ms``)."""

    def __init__(self, decoders: list[Decoder]) -> None:
        self.decoders = list(decoders)
        self.cache = self.graph = None
        if len(self.decoders) > 1:
            self._join()

    def __enter__(self) -> BatchDecoder:
        return self

    def __exit__(self, *exc) -> None:
        self.cache = None

    def _join(self) -> None:
        caches = [d.cache for d in self.decoders]
        lengths = [c.get_seq_length() for c in caches]
        self.lm = self.decoders[0].lm
        device = self.lm.device
        width = max(lengths)
        self.cache = (TieredCache.batch_of(caches) if isinstance(caches[0], TieredCache)
                      else left_padded(caches, width))
        graph = self.decoders[0].graph  # a method with graphs: the batch's steps captured too
        self.graph = None if graph is None else GraphedDecode(self.lm.model, self.cache,
                                                              graph.graph)
        self.positions = torch.tensor(lengths, device=device)
        self.mask = (torch.arange(width, device=device)[None]
                     >= (width - self.positions)[:, None]).long()

    @torch.inference_mode()
    def step(self, tokens: list[int]) -> torch.Tensor:
        """Decode one token per sequence (``tokens``, in batch order); FP32 logits
        ``[B, vocab]``."""
        if self.cache is None:
            return self.decoders[0].step(tokens[0])[None]
        ids = torch.tensor(tokens, device=self.lm.device)[:, None]
        self.mask = torch.cat([self.mask, torch.ones_like(self.mask[:, :1])], dim=1)
        _sync(self.lm.device)
        start = time.perf_counter()
        if self.graph is None:
            logits = self.lm.model(input_ids=ids, attention_mask=self.mask,
                                   position_ids=self.positions[:, None], use_cache=True,
                                   **cache_kwargs(self.lm.model, self.cache)).logits
        else:  # certkv's decode attention reads no mask: a graph's step takes none
            logits = self.graph(ids, self.positions)
        _sync(self.lm.device)
        ms = 1e3 * (time.perf_counter() - start)
        self.positions = self.positions + 1
        for decoder in self.decoders:
            decoder.step_ms.append(ms)
            if decoder.on_step is not None:
                decoder.on_step()
        return logits[:, -1].float()

    def keep(self, rows: list[int]) -> None:
        """Only the sequences at ``rows`` go on (the others leave; nothing is copied but the
        dense method's padded tensors)."""
        self.decoders = [self.decoders[r] for r in rows]
        if self.cache is None or not rows:
            return
        index = torch.tensor(rows, device=self.mask.device)
        self.cache.batch_select_indices(index)
        self.mask, self.positions = self.mask[index], self.positions[index]


def left_padded(caches: list[DynamicCache], width: int) -> DynamicCache:
    """The model's own caches (one sequence each) as one batch: every layer's keys and values
    ``[1, Hkv, T_b, d]`` left-padded with zeros to ``[B, Hkv, width, d]`` (the mask hides the
    padding)."""
    batch = DynamicCache()
    for i, layer in enumerate(caches[0].layers):
        if getattr(layer, "keys", None) is None:
            continue
        keys, values = ([_pad_left(getattr(c.layers[i], name), width) for c in caches]
                        for name in ("keys", "values"))
        batch.update(torch.cat(keys), torch.cat(values), i)
    return batch


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x [1, Hkv, T, d]`` with ``width - T`` zero positions in front."""
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[2], 0))
