"""Needle-in-a-haystack prompts built from real book text (arXiv 2605.20868 Sec. 8).

:func:`make_multi_needle_trials` is the paper's protocol: ten fixed needles per trial, needle
``j`` at depth ``DEPTHS[j]`` (depth-major order), inserted before filler sentence
``floor(depth * num_filler_sentences)``; each needle is then asked about separately.

:func:`make_trials` is the single-needle variant: a trial hides one needle sentence, e.g.
``The secret passkey is 4821.``, in a window of book
sentences (the filler) at a depth from ``DEPTHS`` and asks for it at the end, so that a small
base or instruct model answers by continuation::

    A secret passkey is hidden in the text below. Find it and remember it.

    <filler before> The secret passkey is 4821. <filler after>

    What is the secret passkey mentioned in the text? The secret passkey is

Token counts come from the evaluated model's tokenizer without special tokens (a BOS the runner
adds is not counted). Every trial is a pure function of ``(tokenizer, text, context_tokens,
num_trials, seed, kind)`` and its index.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from certkv.errors import CertKVError
from certkv.eval.corpora import encode, encode_many

DEPTHS: tuple[float, ...] = tuple(i / 10 for i in range(10))
CITIES = ("Reykjavik", "Montevideo", "Tbilisi", "Ulaanbaatar", "Nairobi", "Kyoto", "Valparaiso",
          "Tashkent", "Windhoek", "Hobart", "Cusco", "Trondheim")
CODENAMES = ("Blue Heron", "Copper Lantern", "Silent Orchid", "Iron Meadow", "Velvet Comet",
             "Amber Falcon", "Glass Tortoise", "Hollow Pine", "Crimson Otter", "Quiet Glacier")
KINDS = ("passkey", "city", "codename")

# A sentence ends at . ! ? plus closing quotes/brackets/underscores, then whitespace; never after
# a title abbreviation (Mr. Knightley) or a single capital initial (CHAPTER I. / T. Smith).
_ABBREVIATIONS = ("Mr", "Mrs", "Dr", "St", "Rev", "Messrs")
_SENTENCE_END = re.compile(
    "".join(rf"(?<!\b{a})" for a in _ABBREVIATIONS) + r"(?<!\b[A-Z])[.!?][\"'”’)\]_]*\s+"
)


@dataclass(frozen=True)
class NeedleTrial:
    """One prompt: ``answer`` is hidden at relative ``depth`` (0 = start, 0.9 = near the end of
    the filler); the prompt has at most ``context_tokens`` tokens; ``index`` is its trial number."""

    prompt: str
    answer: str
    depth: float
    context_tokens: int
    index: int


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` in order, each with its whitespace (line breaks too) collapsed."""
    sentences, begin = [], 0
    for match in _SENTENCE_END.finditer(text):
        sentences.append(" ".join(text[begin : match.end()].split()))
        begin = match.end()
    sentences.append(" ".join(text[begin:].split()))
    return [s for s in sentences if s]


def _scaffold(kind: str) -> tuple[str, str, str]:
    """(header, needle template, question) for a needle kind; the template takes ``answer``."""
    header = f"A secret {kind} is hidden in the text below. Find it and remember it."
    needle = f"The secret {kind} is {{answer}}."
    question = f"What is the secret {kind} mentioned in the text? The secret {kind} is"
    return header, needle, question


def _draw_answer(rng: random.Random, kind: str, filler: str) -> str:
    """A passkey (4-5 digits), city or codename that does not already occur in the filler."""
    while True:
        if kind == "passkey":
            answer = str(rng.randrange(1000, 100000))
        else:
            answer = rng.choice(CITIES if kind == "city" else CODENAMES)
        if answer.lower() not in filler.lower():
            return answer


def _needle_boundary(costs: list[int], depth: float) -> int:
    """Sentence boundary k (needle goes before sentence k) whose token offset is nearest to
    ``floor(depth * sum(costs))``; ``costs`` are the filler sentences' token counts."""
    target = int(depth * sum(costs))
    offset, best, best_gap = 0, 0, target
    for k, cost in enumerate(costs, start=1):
        offset += cost
        if abs(offset - target) < best_gap:
            best, best_gap = k, abs(offset - target)
    return best


def _assemble(kind: str, filler: list[str], costs: list[int], depth: float, answer: str) -> str:
    """The prompt text: header, filler with the needle at ``depth``, question line."""
    header, needle, question = _scaffold(kind)
    k = _needle_boundary(costs, depth)
    body = " ".join([*filler[:k], needle.format(answer=answer), *filler[k:]])
    return f"{header}\n\n{body}\n\n{question}"


def _pick_filler(
    rng: random.Random, sentences: list[str], costs: list[int], budget: int
) -> tuple[list[str], list[int]]:
    """Consecutive sentences from a random start whose token costs sum to at most ``budget``
    (as many as fit); the start is drawn among those leaving at least ``budget`` tokens."""
    suffix, total = [], 0
    for cost in reversed(costs):
        total += cost
        suffix.append(total)
    suffix.reverse()
    starts = sum(1 for s in suffix if s >= budget)
    if starts == 0:
        raise CertKVError(f"the text has {total} tokens but a {budget}-token filler is needed; "
                          f"use a longer book or a smaller context_tokens.")
    first = rng.randrange(starts)
    end, used = first, 0
    while end < len(costs) and used + costs[end] <= budget:
        used += costs[end]
        end += 1
    if end == first:
        raise CertKVError(f"the book sentence at index {first} alone exceeds the {budget}-token "
                          f"filler budget; use a larger context_tokens.")
    return sentences[first:end], costs[first:end]


def _fit(tokenizer: Any, kind: str, filler: list[str], costs: list[int], depth: float,
         answer: str, context_tokens: int) -> str:
    """Assemble the prompt, dropping filler sentences from the end until its exact token count
    under ``tokenizer`` is at most ``context_tokens``."""
    while True:
        prompt = _assemble(kind, filler, costs, depth, answer)
        overflow = len(encode(tokenizer, prompt)) - context_tokens
        if overflow <= 0:
            return prompt
        if not filler:
            raise CertKVError(f"even an empty filler exceeds context_tokens={context_tokens}; "
                              f"use a larger context_tokens.")
        while filler and overflow > 0:
            overflow -= costs[-1]
            filler, costs = filler[:-1], costs[:-1]


def make_trials(
    tokenizer: Any,
    text: str,
    context_tokens: int,
    num_trials: int,
    seed: int = 20260416,
    *,
    kind: str = "passkey",
) -> list[NeedleTrial]:
    """``num_trials`` needle trials of at most ``context_tokens`` tokens each, depth-major.

    Trial ``i`` has depth ``DEPTHS[i * 10 // num_trials]`` (so trials run through the depths in
    order, equally many per depth when ``num_trials`` is a multiple of 10), its own filler
    window of consecutive book sentences and its own answer, both drawn from
    ``random.Random(f"{seed}:{i}")``. ``kind`` is ``"passkey"`` (4-5 digit number), ``"city"``
    or ``"codename"``. ``tokenizer`` needs ``encode`` (HF tokenizers: special tokens off).
    """
    if kind not in KINDS:
        raise CertKVError(f"unknown needle kind {kind!r}; use one of {', '.join(KINDS)}.")
    if num_trials < 1:
        raise CertKVError(f"num_trials must be at least 1, got {num_trials}; pass a positive "
                          f"count.")
    sentences = split_sentences(text)
    costs = [len(ids) for ids in encode_many(tokenizer, [" " + s for s in sentences])]
    header, needle, question = _scaffold(kind)
    fixed = len(encode(tokenizer, f"{header}\n\n{needle.format(answer='00000')}\n\n{question}"))
    budget = context_tokens - fixed - 8
    if budget < 1:
        raise CertKVError(f"context_tokens={context_tokens} leaves no room for filler after the "
                          f"{fixed}-token question; use at least {fixed + 64}.")
    trials = []
    for index in range(num_trials):
        rng = random.Random(f"{seed}:{index}")
        depth = DEPTHS[index * len(DEPTHS) // num_trials]
        filler, filler_costs = _pick_filler(rng, sentences, costs, budget)
        answer = _draw_answer(rng, kind, " ".join(filler))
        prompt = _fit(tokenizer, kind, filler, filler_costs, depth, answer, context_tokens)
        trials.append(NeedleTrial(prompt, answer, depth, context_tokens, index))
    return trials


def score(answer: str, generated: str) -> float:
    """1.0 if ``answer`` occurs in ``generated`` (case-insensitive substring), else 0.0."""
    if not answer:
        raise CertKVError("score needs a non-empty answer; pass the trial's answer string.")
    return 1.0 if answer.lower() in generated.lower() else 0.0


# The paper's ten fixed needles: (project, codename); needle j sits at depth DEPTHS[j].
FIXED_NEEDLES: tuple[tuple[str, str], ...] = (
    ("Aurora", "Crimson Falcon"), ("Basalt", "Silent Orchid"), ("Cobalt", "Velvet Comet"),
    ("Driftwood", "Amber Lantern"), ("Ember", "Glass Tortoise"), ("Fjord", "Copper Heron"),
    ("Granite", "Hollow Pine"), ("Harbor", "Quiet Glacier"), ("Indigo", "Iron Meadow"),
    ("Juniper", "Blue Otter"))
_MULTI_HEADER = ("Ten secret project codenames are hidden in the text below. Find them and "
                 "remember them.")


def _multi_needle(key: str, value: str) -> str:
    return f"The secret codename of project {key} is {value}."


def _multi_question(key: str) -> str:
    return (f"What is the secret codename of project {key}? The secret codename of project "
            f"{key} is")


@dataclass(frozen=True)
class MultiNeedleTrial:
    """One trial of the paper's NIAH: ``document`` (header and filler with the ten needles,
    ending in a blank line) is read once; ``questions[j]`` asks for ``answers[j]``, the needle
    at ``depths[j]``; document plus the longest question plus ``answer_tokens`` fit in
    ``context_tokens``."""

    document: str
    questions: tuple[str, ...]
    answers: tuple[str, ...]
    depths: tuple[float, ...]
    context_tokens: int
    index: int


def _multi_document(filler: list[str]) -> str:
    """Header, then the filler with needle ``j`` before sentence
    ``floor(DEPTHS[j] * len(filler))``, then a blank line."""
    body: list[str] = []
    slots = [int(depth * len(filler)) for depth in DEPTHS]
    for k in range(len(filler) + 1):
        body += [_multi_needle(*FIXED_NEEDLES[j]) for j, slot in enumerate(slots) if slot == k]
        if k < len(filler):
            body.append(filler[k])
    return f"{_MULTI_HEADER}\n\n{' '.join(body)}\n\n"


def make_multi_needle_trials(tokenizer: Any, text: str, context_tokens: int, num_trials: int,
                             seed: int = 20260416, *,
                             answer_tokens: int = 16) -> list[MultiNeedleTrial]:
    """``num_trials`` trials of the paper's ten-needle NIAH at ``context_tokens`` tokens.

    Trial ``i`` reads its own window of consecutive book sentences (start drawn from
    ``random.Random(f"{seed}:{i}")``) with the ten :data:`FIXED_NEEDLES` at depths 0.0-0.9;
    sentences are dropped from the end until the document, the longest question and
    ``answer_tokens`` fit in ``context_tokens`` (tokens of ``tokenizer``, special tokens off).
    """
    if num_trials < 1:
        raise CertKVError(f"num_trials must be at least 1, got {num_trials}; pass a positive "
                          f"count.")
    lowered = text.lower()
    for _, value in FIXED_NEEDLES:
        if value.lower() in lowered:
            raise CertKVError(f"the book already contains the needle value {value!r}; use "
                              f"another book.")
    sentences = split_sentences(text)
    costs = [len(ids) for ids in encode_many(tokenizer, [" " + s for s in sentences])]
    questions = tuple(_multi_question(key) for key, _ in FIXED_NEEDLES)
    fixed = (len(encode(tokenizer, _multi_document([])))
             + sum(len(encode(tokenizer, " " + _multi_needle(*n))) for n in FIXED_NEEDLES))
    budget = (context_tokens - answer_tokens - fixed
              - max(len(encode(tokenizer, q)) for q in questions) - 8)
    if budget < 1:
        raise CertKVError(f"context_tokens={context_tokens} leaves no room for filler after "
                          f"the ten needles and a question; use at least "
                          f"{context_tokens - budget + 64}.")
    trials = []
    for index in range(num_trials):
        rng = random.Random(f"{seed}:{index}")
        filler, filler_costs = _pick_filler(rng, sentences, costs, budget)
        limit = context_tokens - answer_tokens - max(len(encode(tokenizer, q))
                                                     for q in questions)
        while len(encode(tokenizer, _multi_document(filler))) > limit and filler:
            filler, filler_costs = filler[:-1], filler_costs[:-1]
        trials.append(MultiNeedleTrial(_multi_document(filler), questions,
                                       tuple(value for _, value in FIXED_NEEDLES), DEPTHS,
                                       context_tokens, index))
    return trials
