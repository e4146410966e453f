"""The evaluation protocol in batches (:mod:`certkv.eval.batch`): requests of ragged prompts
decoded together give each the answer it gets alone, each with its own certificates, every
(sequence, head) of a certified batch within its bound; a finished request leaves the batch."""

from __future__ import annotations

import pytest
import torch
from helpers.models import ContractChecker

from certkv import CertifiedAttention
from certkv.errors import ConfigError
from certkv.eval import decode
from certkv.eval.batch import Request, answer_all
from certkv.eval.decode import Method, Prefill
from certkv.models import load_model
from certkv.models.hf_cache import CacheSpec, TieredCache

TINY = {"name": "tiny_random", "device": "cpu", "seed": 0,
        "random_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                          "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "head_dim": 16,
                          "max_position_embeddings": 8192}}
LENGTHS = (300, 41, 170, 90)  # ragged prompts: the batch's widest and narrowest differ 7x


@pytest.fixture(scope="module")
def lm():
    return load_model(TINY)


@pytest.fixture
def no_eos(monkeypatch):
    """Generation runs to its budget (a random model's end-of-sequence would cut it short)."""
    monkeypatch.setattr(decode, "end_of_sequence_ids", lambda _: set())
    import certkv.eval.batch as batch

    monkeypatch.setattr(batch, "end_of_sequence_ids", lambda _: set())


def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 500, (n,), generator=gen).tolist() for n in LENGTHS]


def requests(lm, method: Method, spec: CacheSpec | None = None) -> list[Request]:
    """Two generations (budgets 9 and 3: the second leaves first) and two teacher-forced
    scorings (12 and 5 tokens), one on a fed question after its prefill."""
    out = []
    for i, ids in enumerate(prompts()):
        session = Prefill(lm, ids[:-1]).session(method, spec)
        if i % 2 == 0:
            out.append(Request(session, ids[-1], target=list(range(7, 7 + 12 - 7 * (i // 2)))))
        else:
            out.append(Request(session, ids[-1], feed=[5, 6, 7] if i == 3 else [],
                               max_new_tokens=9 if i == 1 else 3))
    return out


@pytest.mark.parametrize("mode", ["dense", "naive", "certified"])
def test_a_batch_of_ragged_requests_answers_each_as_alone_with_its_own_certificates(
        lm, no_eos, mode):
    attention = ContractChecker(CertifiedAttention(mode=mode))
    method = Method(mode, mode, attention)
    full = CacheSpec(records="full")  # every head's record, with its sequence
    alone, batched = requests(lm, method, full), requests(lm, method, full)
    one = answer_all(alone, batch_size=1)
    checked = attention.head_steps
    many = answer_all(batched, batch_size=4)
    for i, (a, b, request) in enumerate(zip(one, many, batched, strict=True)):
        assert a.tokens == b.tokens and len(b.tokens) == request.max_new_tokens
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-3)  # a batch's matmul order
        assert len(b.logprobs) == len(request.target) and a.greedy == b.greedy
        assert (a.batch, b.batch) == (1, 4)
        steps = len(request.target) or request.max_new_tokens
        (decoder,) = request.session.decoders
        assert len(decoder.step_ms) == steps and decoder.cache is None  # closed
        record = request.session.certificate_record()
        assert record.get("steps", 0) == (0 if mode == "dense" else steps)  # its own steps
        heads = [h for t in request.session.telemetry() for h in t.log.heads]
        assert {h["sequence"] for h in heads} == (set() if mode == "dense" else {i})
    if mode != "dense":  # every (sequence, head) of every batched step against FP64
        steps = sum(len(r.target) or r.max_new_tokens for r in batched)
        assert attention.head_steps - checked == steps * 2 * 4  # layers x query heads


def test_a_batch_joins_only_caches_of_one_method(lm):
    ids = prompts()[0]
    shared = Prefill(lm, ids[:-1])
    caches = [shared.cache_for(Method.build(m, m)) for m in ("naive", "certified")]
    with pytest.raises(ConfigError, match="must share one method"):
        TieredCache.batch_of(caches)


@pytest.fixture
def rows_alone(monkeypatch):
    """The model's linear layers compute a batch row by row, as for one sequence (their
    reduction order then no longer depends on the batch)."""
    linear = torch.nn.functional.linear

    def row_by_row(x, weight, bias=None):
        if x.dim() < 3 or x.shape[0] == 1:
            return linear(x, weight, bias)
        return torch.cat([linear(x[i : i + 1], weight, bias) for i in range(x.shape[0])])

    monkeypatch.setattr(torch.nn.functional, "linear", row_by_row)


@pytest.mark.parametrize("mode", ["naive", "certified"])
def test_a_batch_is_bitwise_alone_once_the_models_products_are_row_by_row(
        lm, no_eos, rows_alone, mode):
    """What a batch changes is the model's matrix products alone: computed row by row, every
    request's answer, log-probabilities and certificate statistics are bit for bit those of
    decoding it alone (the stores, the certified steps, positions and leaving are exact)."""
    method = Method.build(mode, mode)
    alone, batched = requests(lm, method), requests(lm, method)
    for a, b in zip(answer_all(alone, 1), answer_all(batched, 4), strict=True):
        assert (a.tokens, a.logprobs, a.greedy) == (b.tokens, b.logprobs, b.greedy)
    for a, b in zip(alone, batched, strict=True):
        one, many = a.session.certificate_record(), b.session.certificate_record()
        assert one == many


@pytest.mark.slow
def test_a_batch_with_graphs_replays_its_whole_steps_bitwise_as_each_request_alone(
        lm, no_eos, rows_alone, monkeypatch):
    """A method with graphs (the Triton kernels in the interpreter, each step recorded and
    replayed as a CUDA graph replays it) decodes a batch as its whole captured steps
    (:class:`~certkv.graphs.GraphedDecode` over the joined caches, a new bucket when a request
    leaves): with the model's products row by row, every request's tokens, log-probabilities
    and certificate record are those of decoding it alone with graphs, and the batch's steps
    were replayed."""
    from certkv.graphs import GraphedAttention, RecordedGraph

    replays = []
    replay = RecordedGraph.replay
    monkeypatch.setattr(RecordedGraph, "replay", lambda g: replays.append(1) or replay(g))

    def graphed_requests() -> list[Request]:
        method = Method("certified", "certified",
                        GraphedAttention(CertifiedAttention(backend="triton", compile=False),
                                         RecordedGraph))
        return [Request(Prefill(lm, ids[:-1]).session(method), ids[-1],
                        max_new_tokens=(8, 4, 8)[i])
                for i, ids in enumerate(prompts()[1:4])]

    alone, batched = graphed_requests(), graphed_requests()
    one = answer_all(alone, 1)
    replayed_alone = len(replays)
    many = answer_all(batched, 3)
    assert replayed_alone > 0 and len(replays) - replayed_alone > 0
    for a, b in zip(one, many, strict=True):
        assert (a.tokens, a.logprobs, b.batch) == (b.tokens, b.logprobs, 3)
    for a, b in zip(alone, batched, strict=True):
        assert a.session.certificate_record() == b.session.certificate_record()
