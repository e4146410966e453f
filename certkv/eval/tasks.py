"""Tasks of the ``task`` config group: teacher-forced perplexity and needle retrieval.

Each task turns a tokenizer into samples; every sample is prefilled once with dense attention
(paper 8), then each method decodes from the last prompt token on its own copy of the cache, so
the first predicted token already comes from the method under test. ``evaluate`` receives the
method's :class:`~certkv.eval.decode.Session` and asks it for decoders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from certkv.errors import CertKVError, require
from certkv.eval.corpora import book_text, token_windows
from certkv.eval.niah import make_trials, score


@dataclass
class Sample:
    """One prompt: ``prefix`` is prefilled densely, ``first`` starts the decode."""

    index: int
    prefix: list[int]
    first: int
    target: list[int] = field(default_factory=list)  # teacher-forced continuation
    answer: str = ""  # expected retrieval
    meta: dict = field(default_factory=dict)


def _check_context(context: int, max_context: int, task: str) -> None:
    require(context <= max_context, CertKVError,
            f"{task} context {context} exceeds the model's {max_context} tokens; lower "
            f"task.{task}.context.")


@dataclass
class PerplexityTask:
    """Perplexity of the last ``decode_tokens`` of each book window, each token predicted by a
    decode step of the method (teacher forcing); the rest of the window is dense prefill."""

    book: str = "emma"
    context: int = 2048
    decode_tokens: int = 64
    windows: int = 1
    name: str = "perplexity"

    def samples(self, tokenizer, max_context: int) -> list[Sample]:
        _check_context(self.context, max_context, self.name)
        require(0 < self.decode_tokens < self.context, CertKVError,
                f"decode_tokens={self.decode_tokens} must lie in [1, context); lower it.")
        windows = token_windows(tokenizer, book_text(self.book), self.context, self.windows)
        split = self.context - self.decode_tokens
        return [Sample(i, w[: split - 1], w[split - 1], target=w[split:],
                       meta={"book": self.book, "context": self.context})
                for i, w in enumerate(windows)]

    def evaluate(self, session, sample: Sample) -> dict:
        decoder = session.decoder()
        nll, token = 0.0, sample.first
        for target in sample.target:
            logits = decoder.step(token)
            nll -= float(torch.log_softmax(logits, dim=-1)[target])
            token = target
        n = len(sample.target)
        return {"nll": nll, "tokens": n, "ppl": math.exp(nll / n)}

    @staticmethod
    def aggregate(records: list[dict]) -> dict:
        nll = sum(r["nll"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        return {"ppl": math.exp(nll / tokens), "tokens": tokens}


@dataclass
class NeedleTask:
    """Needle-in-a-haystack on book text: greedy answer of ``max_new_tokens`` tokens, scored by
    case-insensitive substring match."""

    book: str = "emma"
    context: int = 2048
    trials: int = 5
    max_new_tokens: int = 8
    seed: int = 20260416
    name: str = "niah"

    def samples(self, tokenizer, max_context: int) -> list[Sample]:
        _check_context(self.context, max_context, self.name)
        trials = make_trials(tokenizer, book_text(self.book), self.context, self.trials,
                             seed=self.seed)
        out = []
        for t in trials:
            ids = tokenizer.encode(t.prompt, add_special_tokens=False)
            out.append(Sample(t.index, ids[:-1], ids[-1], answer=t.answer,
                              meta={"depth": t.depth, "context": len(ids)}))
        return out

    def evaluate(self, session, sample: Sample) -> dict:
        decoder = session.decoder()
        text = decoder.tokenizer.decode(decoder.generate(sample.first, self.max_new_tokens))
        return {"generated": text, "answer": sample.answer, "score": score(sample.answer, text)}

    @staticmethod
    def aggregate(records: list[dict]) -> dict:
        return {"accuracy": sum(r["score"] for r in records) / len(records),
                "trials": len(records)}
