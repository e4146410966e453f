"""Needle-in-a-haystack trials: deterministic, depth-major, within the token budget, needle at
the requested depth at a sentence boundary; scoring by case-insensitive substring."""

from __future__ import annotations

import re

import pytest
from helpers import WordTokenizer

from certkv.errors import CertKVError
from certkv.eval.niah import (
    DEPTHS,
    FIXED_NEEDLES,
    NeedleTrial,
    make_multi_needle_trials,
    make_trials,
    score,
    split_sentences,
)


def book(sentences: int = 600) -> str:
    """Austen-like filler: varied sentences with titles, quotes and line breaks."""
    lines = []
    for i in range(sentences):
        who = ("Mr. Knightley", "Mrs. Weston", "Emma", "Harriet")[i % 4]
        lines.append(f'{who} walked to the garden on day {i} and\nsaid, "How very pleasant!"'
                     if i % 3 == 0 else f"{who} thought about letter {i} for a while.")
    return "CHAPTER I.\n\n" + " ".join(lines)


@pytest.fixture
def tok():
    return WordTokenizer()


def test_split_sentences_respects_titles_and_quotes():
    text = 'Mr. Knightley came in. "Ah! there is no end," said she.\nThen Dr. Perry left?'
    assert split_sentences(text) == [
        "Mr. Knightley came in.", '"Ah!', 'there is no end," said she.', "Then Dr. Perry left?"]


def test_trials_are_deterministic_and_seeded(tok):
    a = make_trials(tok, book(), context_tokens=300, num_trials=10)
    b = make_trials(WordTokenizer(), book(), context_tokens=300, num_trials=10)
    c = make_trials(tok, book(), context_tokens=300, num_trials=10, seed=1)
    assert a == b
    assert [t.prompt for t in a] != [t.prompt for t in c]
    assert len({t.answer for t in a}) > 5


def test_depth_major_enumeration(tok):
    trials = make_trials(tok, book(), context_tokens=200, num_trials=20)
    assert [t.depth for t in trials] == [d for d in DEPTHS for _ in range(2)]
    assert [t.index for t in trials] == list(range(20))
    assert [t.depth for t in make_trials(tok, book(), 200, 5)] == [0.0, 0.2, 0.4, 0.6, 0.8]


@pytest.mark.parametrize("context_tokens", [120, 400, 1500])
def test_prompt_fits_and_needle_sits_at_depth(tok, context_tokens):
    for trial in make_trials(tok, book(), context_tokens, num_trials=10):
        assert isinstance(trial, NeedleTrial) and trial.context_tokens == context_tokens
        assert len(tok.encode(trial.prompt, add_special_tokens=False)) <= context_tokens
        needle = f"The secret passkey is {trial.answer}."
        assert trial.prompt.count(needle) == 1 and re.fullmatch(r"\d{4,5}", trial.answer)
        _header, body, question = trial.prompt.split("\n\n")
        assert question == ("What is the secret passkey mentioned in the text? "
                            "The secret passkey is")
        before, after = body.split(needle)
        assert trial.answer not in before + after
        assert before == "" or before.endswith((". ", "! ", '!" ', "? "))
        words_before, words_total = len(before.split()), len((before + after).split())
        assert words_total > context_tokens - 60
        assert abs(words_before / words_total - trial.depth) < 30 / words_total + 0.02


@pytest.mark.parametrize(("kind", "pool"), [("city", "Reykjavik Kyoto Hobart Cusco Nairobi"),
                                             ("codename", "Blue Heron Amber Falcon Iron")])
def test_other_needle_kinds(tok, kind, pool):
    trials = make_trials(tok, book(), 300, num_trials=10, kind=kind)
    for trial in trials:
        assert f"The secret {kind} is {trial.answer}." in trial.prompt
        assert trial.prompt.endswith(f"The secret {kind} is")
    assert any(word in pool for t in trials for word in t.answer.split())


def test_bad_arguments_name_the_fix(tok):
    with pytest.raises(CertKVError, match="use at least"):
        make_trials(tok, book(), context_tokens=30, num_trials=1)
    with pytest.raises(CertKVError, match="use a longer book or a smaller context_tokens"):
        make_trials(tok, book(sentences=20), context_tokens=2000, num_trials=1)
    with pytest.raises(CertKVError, match="unknown needle kind 'color'"):
        make_trials(tok, book(), 300, 1, kind="color")
    with pytest.raises(CertKVError, match="num_trials must be at least 1"):
        make_trials(tok, book(), 300, 0)


def test_score():
    assert score("4821", " 4821.<|im_end|>") == 1.0
    assert score("Reykjavik", "the secret city is REYKJAVIK") == 1.0
    assert score("4821", " 4812.") == 0.0
    with pytest.raises(CertKVError, match="non-empty answer"):
        score("", "anything")


@pytest.mark.parametrize("context_tokens", [400, 1500])
def test_ten_needle_trials_follow_the_paper(tok, context_tokens):
    """Ten fixed needles per trial at depths 0.0-0.9 (depth-major), needle j before filler
    sentence floor(j/10 x sentences); the document, the longest question and the answer budget
    fit; each question asks for its needle; trials are seeded and differ in their filler."""
    trials = make_multi_needle_trials(tok, book(), context_tokens, num_trials=3,
                                      answer_tokens=16)
    again = make_multi_needle_trials(WordTokenizer(), book(), context_tokens, num_trials=3,
                                     answer_tokens=16)
    assert trials == again and trials[0].document != trials[1].document
    for trial in trials:
        assert trial.answers == tuple(v for _, v in FIXED_NEEDLES) and trial.depths == DEPTHS
        longest = max(len(tok.encode(q, add_special_tokens=False)) for q in trial.questions)
        assert len(tok.encode(trial.document, add_special_tokens=False)) + longest + 16 \
            <= context_tokens
        _header, body, _ = trial.document.split("\n\n")
        sentences = split_sentences(body)
        needles = [f"The secret codename of project {k} is {v}." for k, v in FIXED_NEEDLES]
        positions = [sentences.index(n) for n in needles]
        assert positions == sorted(positions)  # depth-major
        filler = len(sentences) - 10
        assert filler > 0
        for j, position in enumerate(positions):
            assert position - j == int(DEPTHS[j] * filler)  # filler sentences before needle j
        for (key, value), question in zip(FIXED_NEEDLES, trial.questions, strict=True):
            assert key in question and value not in question
            assert question.endswith(f"The secret codename of project {key} is")


def test_ten_needle_trials_reject_a_book_that_holds_a_needle_value(tok):
    with pytest.raises(CertKVError, match="already contains the needle value"):
        make_multi_needle_trials(tok, book() + " Crimson Falcon.", 400, num_trials=1)
