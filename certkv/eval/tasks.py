"""Tasks of the ``task`` config group: the paper's evaluation protocol (Section 8).

* :class:`PerplexityTask` -- PG-19's: non-overlapping windows of ``context`` tokens, the first
  half prefilled densely, the second half teacher-forced through the method.
* :class:`NeedleTask` -- NIAH: ten fixed needles per trial at depths 0.0-0.9, each asked
  separately; a trial passes only if all ten are retrieved (``needles=1``: one per trial).
* :class:`RulerTask` -- RULER's synthetic subtasks (:mod:`certkv.eval.ruler`); a slice is one
  sample of every subtask.

Each task turns a tokenizer into samples; every sample is prefilled once with dense attention
(paper 8), then each method decodes from the last prompt token on its own copy of the cache, so
the first predicted token already comes from the method under test. A task says what a sample
asks a method (``requests``: one :class:`~certkv.eval.batch.Request` per question, on the
method's :class:`~certkv.eval.decode.Session`) and how the answers score (``score``); the runner
decodes ``batch_size`` requests at a time (:func:`~certkv.eval.batch.answer_all`). Every
generation is greedy and stops at end-of-sequence or the task's answer budget.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from certkv.errors import CertKVError, require
from certkv.eval import ruler
from certkv.eval.batch import Answer, Request, answer_all
from certkv.eval.corpora import book_text, corpus_windows, encode
from certkv.eval.niah import make_multi_needle_trials, make_trials
from certkv.eval.niah import score as retrieved
from certkv.registry import TASKS


@dataclass
class Sample:
    """One prompt: ``prefix`` is prefilled densely, ``first`` starts the decode; ``meta`` is
    recorded with the results, ``payload`` is what ``evaluate`` needs (not recorded)."""

    index: int
    prefix: list[int]
    first: int
    target: list[int] = field(default_factory=list)  # teacher-forced continuation
    answer: str = ""  # expected retrieval
    meta: dict = field(default_factory=dict)
    payload: Any = None


BATCH_SIZE = 4  # sequences decoded at once by default: see docs/evaluation.md, "Batches"


def _check_batch_size(task) -> None:
    require(isinstance(task.batch_size, int) and task.batch_size > 0, CertKVError,
            f"task.{task.name}.batch_size={task.batch_size!r} must be a positive number of "
            f"sequences decoded at once; e.g. task.{task.name}.batch_size=1.")


class Task:
    """What every task shares: :meth:`evaluate` one sample alone, from the task's
    ``requests`` (the questions a sample asks a method) and ``score`` (its record from the
    answers); the runner answers many samples' requests in batches of ``batch_size``."""

    def evaluate(self, session, sample: Sample) -> dict:
        """The record of ``sample`` for the method of ``session``, decoded alone."""
        answers = answer_all(self.requests(session, sample))
        return self.score(sample, answers, session.prefill.lm.tokenizer)


def _check_context(context: int, max_context: int, task: str) -> None:
    require(0 < context <= max_context, CertKVError,
            f"{task} context {context} must lie in [1, {max_context}] (the model's context); "
            f"set task.{task}.context accordingly.")


@TASKS.register("perplexity")
@dataclass
class PerplexityTask(Task):
    """Teacher-forced perplexity, the paper's PG-19 protocol: ``windows`` non-overlapping windows
    of ``context`` tokens from ``corpus``; the first ``context - decode_tokens`` tokens of a
    window are prefilled densely and every later token is predicted by a decode step of the
    method (``decode_tokens=None``: half the window, as in the paper).

    ``corpus``: a book name, ``books`` (every offline book), a directory of ``.txt`` files, or
    ``pg19`` (PG-19's test split from the hub, when online).
    """

    corpus: str = "books"
    context: int = 4096
    decode_tokens: int | None = None
    windows: int = 20
    name: str = "perplexity"
    batch_size: int = BATCH_SIZE

    def __post_init__(self) -> None:
        _check_batch_size(self)

    def samples(self, tokenizer, max_context: int) -> list[Sample]:
        _check_context(self.context, max_context, self.name)
        decode = self.context // 2 if self.decode_tokens is None else self.decode_tokens
        require(0 < decode < self.context, CertKVError,
                f"decode_tokens={decode} must lie in [1, context); lower it.")
        split = self.context - decode
        return [Sample(i, w[: split - 1], w[split - 1], target=w[split:],
                       meta={"document": doc, "context": self.context})
                for i, (doc, w) in enumerate(corpus_windows(tokenizer, self.corpus,
                                                            self.context, self.windows))]

    def requests(self, session, sample: Sample) -> list[Request]:
        return [Request(session, sample.first, target=sample.target)]

    def score(self, sample: Sample, answers: list[Answer], tokenizer) -> dict:
        nll = -sum(answers[0].logprobs)  # the same sum, term by term, as NLL -= log p
        n = len(sample.target)
        return {"nll": nll, "tokens": n, "ppl": math.exp(nll / n)}

    @staticmethod
    def aggregate(records: list[dict]) -> dict:
        nll = sum(r["nll"] for r in records)
        tokens = sum(r["tokens"] for r in records)
        return {"ppl": math.exp(nll / tokens), "tokens": tokens, "windows": len(records)}


@TASKS.register("niah")
@dataclass
class NeedleTask(Task):
    """Needle-in-a-haystack retrieval on book text, scored by case-insensitive substring match.

    ``needles=10`` (the paper): ten fixed needles per trial at depths 0.0-0.9; each is asked in
    its own question after the shared document (a fresh copy of the prefilled cache per
    question); accuracy = the fraction retrieved, a trial passes only if all ten are.
    ``needles=1``: one needle per trial at depth-major depths, asked once. ``context`` bounds
    document, question and answer together.
    """

    book: str = "emma"
    context: int = 4096
    trials: int = 10
    needles: int = 10
    max_new_tokens: int = 16
    seed: int = 20260416
    name: str = "niah"
    batch_size: int = BATCH_SIZE

    def __post_init__(self) -> None:
        _check_batch_size(self)
        require(self.needles in (1, 10), CertKVError,
                f"needles={self.needles} is not supported; use 10 (the paper) or 1.")

    def samples(self, tokenizer, max_context: int) -> list[Sample]:
        _check_context(self.context, max_context, self.name)
        text = book_text(self.book)
        if self.needles == 1:
            return self._single(tokenizer, text)
        trials = make_multi_needle_trials(tokenizer, text, self.context, self.trials,
                                          seed=self.seed, answer_tokens=self.max_new_tokens)
        out = []
        for t in trials:
            ids = encode(tokenizer, t.document)
            questions = [encode(tokenizer, q) for q in t.questions]
            out.append(Sample(t.index, ids, -1, answer=" | ".join(t.answers),
                              meta={"context": len(ids) + max(map(len, questions)),
                                    "needles": len(t.answers)},
                              payload=(questions, t.answers)))
        return out

    def _single(self, tokenizer, text: str) -> list[Sample]:
        trials = make_trials(tokenizer, text, self.context - self.max_new_tokens, self.trials,
                             seed=self.seed)
        out = []
        for t in trials:
            ids = encode(tokenizer, t.prompt)
            out.append(Sample(t.index, ids[:-1], ids[-1], answer=t.answer,
                              meta={"depth": t.depth, "context": len(ids), "needles": 1},
                              payload=None))
        return out

    def requests(self, session, sample: Sample) -> list[Request]:
        """One request per needle question, each on its own copy of the document."""
        if sample.payload is None:  # one needle, its question ends the prefix
            return [Request(session, sample.first, max_new_tokens=self.max_new_tokens)]
        return [Request(session, question[-1], feed=question[:-1],
                        max_new_tokens=self.max_new_tokens) for question in sample.payload[0]]

    def score(self, sample: Sample, answers: list[Answer], tokenizer) -> dict:
        expected = [sample.answer] if sample.payload is None else sample.payload[1]
        generated = [tokenizer.decode(a.tokens) for a in answers]
        found = [retrieved(e, g) for e, g in zip(expected, generated, strict=True)]
        return {"generated": generated, "answers": list(expected), "retrieved": found,
                "accuracy": sum(found) / len(found), "pass": all(found)}

    @staticmethod
    def aggregate(records: list[dict]) -> dict:
        return {"accuracy": statistics.fmean(r["accuracy"] for r in records),
                "pass_rate": statistics.fmean(float(r["pass"]) for r in records),
                "trials": len(records)}


@TASKS.register("ruler")
@dataclass
class RulerTask(Task):
    """RULER's synthetic subtasks (:mod:`certkv.eval.ruler`): ``slices`` slices, each one sample
    of every subtask in ``subtasks`` (the paper's seven by default). ``context`` is the whole
    sequence, prompt and the subtask's answer budget (RULER's ``max_seq_length``); the haystack is
    real book text offline. Greedy answers stop at end-of-sequence or the budget; the score is
    the fraction of required references found (RULER's ``string_match_all``)."""

    subtasks: tuple[str, ...] = ruler.PAPER_SUBTASKS
    context: int = 4096
    slices: int = 10
    book: str = "emma"
    name: str = "ruler"
    batch_size: int = BATCH_SIZE

    def __post_init__(self) -> None:
        _check_batch_size(self)
        self.subtasks = tuple(self.subtasks)
        unknown = [s for s in self.subtasks if s not in ruler.SUBTASKS]
        require(not unknown and self.subtasks, CertKVError,
                f"unknown RULER subtasks {unknown}; choose from {list(ruler.SUBTASKS)}.")

    def samples(self, tokenizer, max_context: int) -> list[Sample]:
        _check_context(self.context, max_context, self.name)
        haystack = book_text(self.book)
        out = []
        for slice_ in range(self.slices):
            for j, subtask in enumerate(self.subtasks):
                sample = ruler.make_sample(tokenizer, subtask, self.context
                                           - ruler.answer_budget(subtask), slice_, haystack)
                ids = encode(tokenizer, sample.prompt)
                out.append(Sample(slice_ * len(self.subtasks) + j, ids[:-1], ids[-1],
                                  answer=" | ".join(sample.answers),
                                  meta={"subtask": subtask, "slice": slice_,
                                        "context": len(ids) + sample.max_new_tokens},
                                  payload=sample))
        return out

    def requests(self, session, sample: Sample) -> list[Request]:
        return [Request(session, sample.first, max_new_tokens=sample.payload.max_new_tokens)]

    def score(self, sample: Sample, answers: list[Answer], tokenizer) -> dict:
        rs: ruler.RulerSample = sample.payload
        text = tokenizer.decode(answers[0].tokens)
        value = ruler.score(rs, text)
        return {"generated": text, "answers": list(rs.answers), "score": value,
                "pass": value == 1.0}

    @staticmethod
    def aggregate(records: list[dict]) -> dict:
        per_subtask: dict[str, list[float]] = {}
        for r in records:
            per_subtask.setdefault(r["subtask"], []).append(r["score"])
        return {"accuracy": statistics.fmean(r["score"] for r in records),
                "trials": len(records),
                "slices": len({r["slice"] for r in records}),
                "subtasks": {k: statistics.fmean(v) for k, v in per_subtask.items()}}
