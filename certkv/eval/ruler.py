"""RULER's synthetic long-context subtasks (Hsieh et al. 2024): prompt generation and scoring.

Written from the paper and NVIDIA's public task definitions (templates, parameters, scoring);
the code and the word lists here are this project's own. Every sample is a pure function of
``(tokenizer, subtask, context_tokens, index, haystack)``: its payload (keys, values, variable
chains, word lists) and its layout come from ``random.Random(sample_seed(...))`` and its filler
is grown until the prompt has between ``context_tokens - margin`` and ``context_tokens`` tokens,
``margin = max(16, context_tokens // 50)`` (about 2%).

Subtasks (paper default -> RULER configuration) and parameters:

===================  ================  =========  =======  ==========  =====================
name                 RULER config      haystack   keys     values      asked
===================  ================  =========  =======  ==========  =====================
niah_single          niah_single_2     book       word     7 digits    1 key
niah_multikey        niah_multikey_1   book       4 words  7 digits    1 of the 4 keys
niah_multivalue      niah_multivalue   book       word     4 x 7 dig.  1 key, all 4 values
niah_multiquery      niah_multiquery   book       4 words  7 digits    all 4 keys at once
niah_single_1        niah_single_1     noise      word     7 digits    1 key
niah_single_2        niah_single_2     book       word     7 digits    1 key
niah_single_3        niah_single_3     book       word     UUID        1 key
niah_multikey_1      niah_multikey_1   book       4 words  7 digits    1 of the 4 keys
niah_multikey_2      niah_multikey_2   needle     word     7 digits    1 key among distractors
niah_multikey_3      niah_multikey_3   needle     UUID     UUID        1 key among distractors
vt                   vt                noise      1 chain of 4 hops (5 variables, 5 digits)
cwe                  cwe               word list  10 common words x30, others x3 (x6 / x1
                                                  below 4096 tokens, as RULER)
fwe                  fwe               coded text 6-letter coded words, Zipf alpha=2.0, top 3
===================  ================  =========  =======  ==========  =====================

Haystacks: ``book`` is consecutive whole sentences of the given text (``split_sentences``),
starting at a sentence drawn from the sample's RNG and wrapping to the text's beginning after
its end; ``noise`` repeats "The grass is green. The sky is blue. The sun is yellow. Here we go.
There and back again." sentence by sentence; ``needle`` is a list of distractor needles with
other keys. Needles ("One of the special magic numbers for KEY is: VALUE.", shuffled) and
variable assignments (in chain order) are inserted at sentence boundaries drawn uniformly from
the sample's RNG. Answer budgets (new tokens): niah* 128, vt 30, cwe 120, fwe 50. Every subtask
is scored with RULER's ``string_match_all`` (``metric="all"``: the fraction of the answers that
occur in the output, case-insensitive); ``metric="part"`` is RULER's ``string_match_part``
(1 if any answer occurs).

Prompts (plain text, no chat template; each ends with an answer prefix continued by the model):

- niah (1 value asked): "A special magic number is hidden within the following text. Make
  sure to memorize it. I will quiz you about the number afterwards.\\n<haystack>\\nWhat is the
  special magic number for KEY mentioned in the provided text? The special magic number for KEY
  mentioned in the provided text is" (several values: "Some special magic numbers are ...",
  "What are all the special magic numbers for K1, K2, K3, and K4 ... text are").
- vt: one worked example, then "Memorize and track the chain(s) of variable assignment hidden
  in the following text.\\n\\n<noise with VAR lines>\\nQuestion: Find all variables that are
  assigned the value 12345 in the text above. Answer: According to the chain(s) of variable
  assignment in the text above, 5 variables are assigned the value 12345, they are:".
- cwe: one worked example, then "Below is a numbered list of words. In these words, some appear
  more often than others. Memorize the ones that appear most often.\\n1. w 2. w ...\\nQuestion:
  What are the 10 most common words in the above list? Answer: The top 10 words that appear
  most often in the list are:".
- fwe: "Read the following coded text and track the frequency of each coded word. Find the three
  most frequently appeared coded words.\\n<coded words>\\nQuestion: Do not provide any
  explanation. Please ignore the dots '...'. What are the three most frequently appeared words
  in the above coded text? Answer: According to the coded text above, the three most frequently
  appeared words are:".

Token counts use :func:`certkv.eval.corpora.encode` (special tokens off), and ``context_tokens``
bounds the prompt alone (RULER's ``max_seq_length`` also counts the answer budget).
"""

from __future__ import annotations

import functools
import hashlib
import math
import random
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

from certkv.errors import CertKVError
from certkv.eval.corpora import encode
from certkv.eval.niah import split_sentences

PAPER_SUBTASKS: tuple[str, ...] = ("niah_single", "niah_multikey", "niah_multivalue",
                                   "niah_multiquery", "vt", "cwe", "fwe")
SUBTASKS: tuple[str, ...] = (*PAPER_SUBTASKS, "niah_single_1", "niah_single_2", "niah_single_3",
                             "niah_multikey_1", "niah_multikey_2", "niah_multikey_3")
BASE_SEED = 20260416

_ALIASES = {"niah_single": "niah_single_2", "niah_multikey": "niah_multikey_1"}
_BUDGET = {"niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
_ATTEMPTS = 8  # layouts tried (each with other RNG draws) before giving up on the margin
_NOISE = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
          "There and back again.")


def _wordlist(text: str) -> list[str]:
    """The whitespace-separated words of ``text``."""
    return text.split()


# Word lists of this project (not RULER's). Words that occur inside another word are dropped
# below so that a substring match of one answer never credits another word.
_ADJECTIVES = _wordlist("""
amber ancient azure bitter bold brave brisk calm cheerful clever copper crimson curious dapper
distant dizzy dusty eager elegant faint fancy fierce fragile frosty frozen gentle gigantic
gloomy golden graceful grumpy hasty hollow humble hungry jagged jolly keen lively lonely lucky
marble mellow mighty misty modest muddy narrow nimble noble orange pale patient peaceful
polite proud purple quiet rapid restless rigid rosy rough rusty sandy scarlet shallow shiny
silent silver sleepy slender smoky sober solemn spicy steady stormy sturdy sunny swift tangled
tender thirsty tidy timid velvet vivid wary wealthy weary windy witty wooden young zealous
""")
_NOUNS = _wordlist("""
acorn anchor apple badger balloon banjo barrel basket beacon beetle bison blanket bottle
bramble bridge bucket button cabin cactus camel candle canoe canyon carpet castle cedar cherry
chimney circus cliff clock cobra comet compass cottage coyote crater cricket crystal dagger
daisy desert dolphin donkey dragon eagle engine falcon feather fiddle forest fountain garden
garlic glacier goblet goose gravel guitar hammer harbor helmet heron hornet iceberg island
jacket jaguar kayak kettle kitten ladder lagoon lantern lemon lizard lobster magnet mango maple
marsh meadow mirror monkey mountain mushroom nutmeg oasis octopus olive orchid otter oyster
panther parcel parrot peach pebble pepper piano pillow planet pocket pumpkin quarry quilt
rabbit raven ribbon river rocket saddle salmon sandal scarf shovel sparrow spider statue
teapot thimble thistle thunder tiger tomato tortoise trellis trumpet tulip tunnel turnip
umbrella valley vessel violin volcano wagon walnut whistle willow window wizard yacht zebra
""")
_VERBS = _wordlist("""
admire arrange bake balance bargain borrow bounce breathe carve chase chatter climb collect
compose dazzle decorate deliver devour discover divide drift dwell embrace erupt escape
explore fasten fetch flicker float forgive gallop gather giggle glide greet grumble guard hike
hover hurry imagine inspect invent jingle juggle kneel knit launch linger march measure mend
mumble navigate nibble observe obtain ponder pounce promise pursue quarrel rescue ripple roam
rummage scatter scribble shiver sketch slumber sprinkle squeeze stumble swallow sweep tremble
tumble twirl unfold vanish wander whisper wobble wrestle yawn zigzag
""")


def _standalone(words: list[str], others: list[str]) -> tuple[str, ...]:
    """``words`` (deduplicated, sorted) without those occurring inside another word of
    ``others``; returns the kept words."""
    return tuple(sorted(w for w in set(words) if not any(w != o and w in o for o in others)))


_ALL_WORDS = _ADJECTIVES + _NOUNS + _VERBS
_WORDS = _standalone(_ALL_WORDS, _ALL_WORDS)  # cwe vocabulary
_KEY_ADJECTIVES = tuple(sorted(set(_WORDS) & set(_ADJECTIVES)))  # word keys: adjective-noun
_KEY_NOUNS = tuple(sorted(set(_WORDS) & set(_NOUNS)))
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
_PSEUDO_SPACE = len(_SYLLABLES) ** 3  # 343000 three-syllable made-up words


@dataclass(frozen=True)
class RulerSample:
    """One RULER prompt: ``prompt`` ends with the answer prefix, ``answers`` are the required
    references, ``metric`` is "all" (string_match_all) or "part" (string_match_part)."""

    subtask: str
    index: int
    context_tokens: int  # the target length
    prompt: str  # everything the model reads, ending with the answer prefix
    answers: tuple[str, ...]  # required references
    max_new_tokens: int  # the subtask's answer budget
    metric: str  # "all" or "part"
    seed: int


@dataclass(frozen=True)
class _Layout:
    """One rendering of a sample with ``n`` filler units: the ``prompt``, its haystack
    ``context``, the filler ``units`` and the ``payloads`` inserted before unit ``positions``."""

    prompt: str
    context: str
    n: int
    units: tuple[str, ...]
    payloads: tuple[str, ...] = ()
    positions: tuple[int, ...] = ()


@dataclass(frozen=True)
class _Task:
    """A sample whose payload is drawn: ``render(rng, n)`` lays it out with ``n`` filler units
    (``cap`` of them at most, None for unbounded); ``valid(n)`` says if ``n`` makes a sound
    sample."""

    answers: tuple[str, ...]
    render: Callable[[random.Random, int], _Layout]
    cap: int | None = None
    valid: Callable[[int], bool] = lambda n: n >= 1


@dataclass(frozen=True)
class _NiahSpec:
    """A NIAH configuration as in RULER's synthetic.yaml."""

    haystack: str  # "noise", "book" or "needle"
    key_kind: str = "words"  # "words" or "uuids"
    value_kind: str = "numbers"  # "numbers" or "uuids"
    keys: int = 1
    values: int = 1
    queries: int = 1


_NIAH: dict[str, _NiahSpec] = {
    "niah_single_1": _NiahSpec("noise"),
    "niah_single_2": _NiahSpec("book"),
    "niah_single_3": _NiahSpec("book", value_kind="uuids"),
    "niah_multikey_1": _NiahSpec("book", keys=4),
    "niah_multikey_2": _NiahSpec("needle"),
    "niah_multikey_3": _NiahSpec("needle", "uuids", "uuids"),
    "niah_multivalue": _NiahSpec("book", values=4),
    "niah_multiquery": _NiahSpec("book", keys=4, queries=4),
}


# --------------------------------------------------------------------------------------------
# Public API


def sample_seed(subtask: str, context: int, index: int) -> int:
    """The sample's RNG seed: ``BASE_SEED + int(md5(f"{subtask}:{context}:{index}"
    .encode("utf-8")).hexdigest()[:8], 16)``, i.e. BASE_SEED plus the first 32 bits of the MD5
    of e.g. ``"cwe:4096:7"`` read as a big-endian hexadecimal number."""
    digest = hashlib.md5(f"{subtask}:{context}:{index}".encode()).hexdigest()
    return BASE_SEED + int(digest[:8], 16)


def make_sample(tokenizer: Any, subtask: str, context_tokens: int, index: int,
                haystack: str) -> RulerSample:
    """One deterministic sample of ``subtask`` whose prompt has between ``context_tokens -
    margin`` and ``context_tokens`` tokens (``margin = max(16, context_tokens // 50)``).

    ``random.Random(sample_seed(subtask, context_tokens, index))`` first draws the payload
    (keys, values, needle order, asked keys; variable chain; word lists), then the layout: the
    book start sentence or the distractor needles, and the insertion points of the payloads,
    uniform over the filler's unit boundaries. The number of filler units is the largest whose
    prompt fits, found by doubling and bisection on exact token counts (``encode``, special
    tokens off); if that lands below the margin (a long last unit), the layout is redrawn from
    the RNG advanced by one more draw, up to 8 times. ``haystack`` is long real text (a book)
    for the book haystacks; the other subtasks ignore it. Returns a :class:`RulerSample` with
    metric "all" and the subtask's answer budget.
    """
    return _build(tokenizer, subtask, context_tokens, index, haystack)[0]


def score(sample: RulerSample, generated: str) -> float:
    """The sample's rule on the model output: the fraction of ``sample.answers`` found in
    ``generated`` (metric "all") or 1.0 if any is found, else 0.0 (metric "part"); matching is
    case-insensitive substring search."""
    if sample.metric not in _RULES:
        raise CertKVError(f"unknown metric {sample.metric!r}; use one of {', '.join(_RULES)}.")
    if not sample.answers:
        raise CertKVError("the sample has no answers; build it with make_sample.")
    return _RULES[sample.metric](sample.answers, generated)


def _match_all(references: tuple[str, ...], output: str) -> float:
    """RULER's string_match_all for one output: the fraction of references it contains."""
    text = output.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def _match_part(references: tuple[str, ...], output: str) -> float:
    """RULER's string_match_part for one output: 1.0 if it contains any reference, else 0.0."""
    text = output.lower()
    return 1.0 if any(ref.lower() in text for ref in references) else 0.0


_RULES: dict[str, Callable[[tuple[str, ...], str], float]] = {"all": _match_all,
                                                              "part": _match_part}


# --------------------------------------------------------------------------------------------
# Fitting the filler to the target length


def _margin(context_tokens: int) -> int:
    """How far below ``context_tokens`` a prompt may end: max(16, 2% of the target)."""
    return max(16, context_tokens // 50)


def _family(subtask: str) -> str:
    """"niah", "vt", "cwe" or "fwe"; raises for an unknown subtask."""
    if subtask not in SUBTASKS:
        raise CertKVError(f"unknown RULER subtask {subtask!r}; use one of {', '.join(SUBTASKS)}.")
    return "niah" if subtask.startswith("niah") else subtask


def answer_budget(subtask: str) -> int:
    """The subtask's answer budget in new tokens (RULER's ``tokens_to_generate``)."""
    return _BUDGET[_family(subtask)]


def _check_args(context_tokens: int, index: int, haystack: str) -> None:
    """Raise for a non-positive context, a negative index or a non-text haystack."""
    if isinstance(context_tokens, bool) or not isinstance(context_tokens, int) \
            or context_tokens < 1:
        raise CertKVError(f"context_tokens={context_tokens!r} is invalid; pass a positive "
                          f"integer token count.")
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise CertKVError(f"index={index!r} is invalid; pass a non-negative integer.")
    if not isinstance(haystack, str):
        raise CertKVError("haystack must be a str; pass a book's text, e.g. book_text('emma').")


def _build(tokenizer: Any, subtask: str, context_tokens: int, index: int,
           haystack: str) -> tuple[RulerSample, _Layout]:
    """The sample and the layout it was rendered from (positions and units, for tests)."""
    family = _family(subtask)
    _check_args(context_tokens, index, haystack)
    seed = sample_seed(subtask, context_tokens, index)
    rng = random.Random(seed)
    if family == "niah":
        task = _niah_task(rng, _NIAH[_ALIASES.get(subtask, subtask)], haystack)
    elif family == "vt":
        task = _vt_task(rng)
    elif family == "cwe":
        task = _cwe_task(rng, context_tokens)
    else:
        task = _fwe_task(rng, context_tokens)
    layout = _fit(tokenizer, task, rng.getstate(), context_tokens, subtask)
    sample = RulerSample(subtask, index, context_tokens, layout.prompt, task.answers,
                         _BUDGET[family], "all", seed)
    return sample, layout


def _layout_rng(state: tuple, attempt: int) -> random.Random:
    """The sample's RNG at ``state`` (after the payload draws), advanced by ``attempt`` draws."""
    rng = random.Random()
    rng.setstate(state)
    for _ in range(attempt):
        rng.random()
    return rng


def _fit(tokenizer: Any, task: _Task, state: tuple, target: int, subtask: str) -> _Layout:
    """The layout with the most filler units whose prompt fits ``target`` tokens, from the first
    attempt (layout RNG) that lands within the margin; raises when none can."""
    margin = _margin(target)
    for attempt in range(_ATTEMPTS):
        def measure(n: int, attempt: int = attempt) -> tuple[_Layout, int]:
            layout = task.render(_layout_rng(state, attempt), n)
            return layout, len(encode(tokenizer, layout.prompt))

        layout, length = _largest_fit(measure, task.cap, target, subtask)
        if layout.n == task.cap and length < target - margin:
            raise CertKVError(f"the haystack text gives only {length} of the {target - margin} "
                              f"prompt tokens {subtask} needs; pass a longer text (a whole "
                              f"book) or a smaller context_tokens.")
        if not task.valid(layout.n):
            raise CertKVError(f"context_tokens={target} leaves too little room for the {subtask} "
                              f"payload and filler; use a larger context_tokens.")
        if length >= target - margin:
            return layout
    raise CertKVError(f"no {subtask} layout of whole filler units lands within {margin} tokens "
                      f"of context_tokens={target}; use a larger context_tokens.")


def _largest_fit(measure: Callable[[int], tuple[_Layout, int]], cap: int | None, target: int,
                 subtask: str) -> tuple[_Layout, int]:
    """(layout, token count) for the largest filler count whose prompt has at most ``target``
    tokens: doubling search from 1, then bisection (up to ``cap`` units when given)."""
    best = measure(0)
    if best[1] > target:
        raise CertKVError(f"context_tokens={target} is too small for the {subtask} question and "
                          f"payload ({best[1]} tokens without filler); use a larger "
                          f"context_tokens.")
    low, high, n = 0, None, 1
    while high is None:
        n = n if cap is None else min(n, cap)
        layout, length = measure(n)
        if length > target:
            high = n
        elif n == cap:
            return layout, length
        else:
            low, best, n = n, (layout, length), 2 * n
    while high - low > 1:
        mid = (low + high) // 2
        layout, length = measure(mid)
        if length <= target:
            low, best = mid, (layout, length)
        else:
            high = mid
    return best


def _weave(units: list[str], payloads: list[str], positions: list[int], sep: str,
           payload_sep: str) -> str:
    """The haystack text: filler ``units`` joined by ``sep`` with ``payloads[i]`` inserted before
    unit ``positions[i]`` (sorted), set off by ``payload_sep``."""
    parts, previous = [], 0
    for position, payload in zip(positions, payloads, strict=True):
        parts += [sep.join(units[previous:position]), payload]
        previous = position
    parts.append(sep.join(units[previous:]))
    return payload_sep.join(part for part in parts if part)


def _uniform_positions(rng: random.Random, count: int, n: int) -> list[int]:
    """``count`` insertion points (unit boundaries 0..n) drawn uniformly, sorted."""
    return sorted(rng.randint(0, n) for _ in range(count))


def _noise_units(n: int) -> list[str]:
    """The first ``n`` sentences of the repeated noise passage."""
    return [_NOISE[i % len(_NOISE)] for i in range(n)]


# --------------------------------------------------------------------------------------------
# Needle in a haystack


@functools.lru_cache(maxsize=4)
def _book_sentences(text: str) -> tuple[str, ...]:
    """The text's sentences (cached: a book is split once per process)."""
    return tuple(split_sentences(text))


def _draw_value(rng: random.Random, kind: str) -> str:
    """A 7-digit number, a UUID, or an adjective-noun word key (RULER's value/key kinds)."""
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(_KEY_ADJECTIVES)}-{rng.choice(_KEY_NOUNS)}"


def _draw_distinct(rng: random.Random, kind: str, count: int, taken: set[str],
                   avoid: str) -> list[str]:
    """``count`` new draws of ``kind`` not in ``taken`` (updated) nor inside the text ``avoid``
    (lower case)."""
    drawn: list[str] = []
    while len(drawn) < count:
        value = _draw_value(rng, kind)
        if value not in taken and value.lower() not in avoid:
            taken.add(value)
            drawn.append(value)
    return drawn


def _plural(kind: str) -> tuple[str, str]:
    """(singular, plural) noun for a value kind."""
    return ("number", "numbers") if kind == "numbers" else ("UUID", "UUIDs")


def _needle(kind: str, key: str, value: str) -> str:
    """One needle sentence."""
    return f"One of the special magic {_plural(kind)[1]} for {key} is: {value}."


def _join_keys(keys: list[str]) -> str:
    """"A", "A and B", or "A, B, and C"."""
    if len(keys) <= 2:
        return " and ".join(keys)
    return ", ".join(keys[:-1]) + ", and " + keys[-1]


def _niah_frame(spec: _NiahSpec, query: str) -> tuple[str, str]:
    """(instruction, question with answer prefix) for a NIAH prompt about ``query``."""
    one, many = _plural(spec.value_kind)
    if spec.queries * spec.values == 1:
        return (f"A special magic {one} is hidden within the following text. Make sure to "
                f"memorize it. I will quiz you about the {one} afterwards.",
                f"What is the special magic {one} for {query} mentioned in the provided text? "
                f"The special magic {one} for {query} mentioned in the provided text is")
    return (f"Some special magic {many} are hidden within the following text. Make sure to "
            f"memorize them. I will quiz you about the {many} afterwards.",
            f"What are all the special magic {many} for {query} mentioned in the provided text? "
            f"The special magic {many} for {query} mentioned in the provided text are")


def _niah_task(rng: random.Random, spec: _NiahSpec, haystack: str) -> _Task:
    """Draw keys, values, needle order and the asked keys; the filler comes with the layout."""
    sentences: tuple[str, ...] = ()
    if spec.haystack == "book":
        sentences = _book_sentences(haystack)
        if not sentences:
            raise CertKVError("the haystack text is empty; pass a book's text, e.g. "
                              "book_text('emma').")
    avoid = haystack.lower() if spec.haystack == "book" else ""
    taken: set[str] = set()
    keys = _draw_distinct(rng, spec.key_kind, spec.keys, taken, avoid)
    values = [_draw_distinct(rng, spec.value_kind, spec.values, taken, avoid) for _ in keys]
    needles = [_needle(spec.value_kind, k, v) for k, vs in zip(keys, values, strict=True)
               for v in vs]
    rng.shuffle(needles)
    asked = rng.sample(range(spec.keys), spec.queries)
    answers = tuple(v for i in asked for v in values[i])
    head, question = _niah_frame(spec, _join_keys([keys[i] for i in asked]))
    seps = {"book": (" ", " "), "noise": (" ", "\n"), "needle": ("\n", "\n")}[spec.haystack]

    def render(r: random.Random, n: int) -> _Layout:
        if spec.haystack == "book":
            start = r.randrange(len(sentences))
            units = [sentences[(start + i) % len(sentences)] for i in range(n)]
        elif spec.haystack == "noise":
            units = _noise_units(n)
        else:
            units = _distractors(r, spec, n, set(taken))
        positions = _uniform_positions(r, len(needles), n)
        context = _weave(units, needles, positions, *seps)
        return _Layout(f"{head}\n{context}\n{question}", context, n, tuple(units),
                       tuple(needles), tuple(positions))

    return _Task(answers, render, cap=len(sentences) if spec.haystack == "book" else None)


def _distractors(rng: random.Random, spec: _NiahSpec, n: int, taken: set[str]) -> list[str]:
    """``n`` distractor needles whose keys and values differ from the sample's own."""
    needles = []
    for _ in range(n):
        key = _draw_distinct(rng, spec.key_kind, 1, taken, "")[0]
        taken.discard(key)  # distractor keys may repeat among themselves, as in RULER
        value = _draw_distinct(rng, spec.value_kind, 1, taken, "")[0]
        taken.discard(value)
        needles.append(_needle(spec.value_kind, key, value))
    return needles


# --------------------------------------------------------------------------------------------
# Variable tracking


_VT_HOPS = 4
_VT_EXAMPLE_NOISE = 10  # noise sentences in the worked example


def _vt_prompt(context: str, value: str, count: int) -> str:
    """A variable-tracking question ending with its answer prefix."""
    return ("Memorize and track the chain(s) of variable assignment hidden in the following "
            f"text.\n\n{context}\nQuestion: Find all variables that are assigned the value "
            f"{value} in the text above. Answer: According to the chain(s) of variable "
            f"assignment in the text above, {count} variables are assigned the value {value}, "
            f"they are:")


def _vt_chain(names: list[str], value: str) -> list[str]:
    """The assignment lines: the first name gets ``value``, each next name the previous one."""
    return [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a}" for a, b in pairwise(names)]


def _vt_task(rng: random.Random) -> _Task:
    """Draw two chains of 5 distinct variables (worked example and question) in noise text."""
    names: list[str] = []
    while len(names) < 2 * (_VT_HOPS + 1):
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    example_value, value = (str(v) for v in rng.sample(range(10000, 100000), 2))
    example_names, chain_names = names[: _VT_HOPS + 1], names[_VT_HOPS + 1 :]
    example_chain = _vt_chain(example_names, example_value)
    spots = _uniform_positions(rng, len(example_chain), _VT_EXAMPLE_NOISE)
    example_context = _weave(_noise_units(_VT_EXAMPLE_NOISE), example_chain, spots, " ", "\n")
    example = (_vt_prompt(example_context, example_value, len(example_names)) + " "
               + " ".join(example_names) + "\n\n")
    chain = _vt_chain(chain_names, value)

    def render(r: random.Random, n: int) -> _Layout:
        units = _noise_units(n)
        positions = _uniform_positions(r, len(chain), n)
        context = _weave(units, chain, positions, " ", "\n")
        return _Layout(example + _vt_prompt(context, value, len(chain_names)), context, n,
                       tuple(units), tuple(chain), tuple(positions))

    return _Task(tuple(chain_names), render)


# --------------------------------------------------------------------------------------------
# Common words extraction


_CWE_COMMON = 10


def _cwe_counts(context_tokens: int) -> tuple[int, int, int, int, int]:
    """(common repeats, uncommon repeats, example words, example common repeats, example
    uncommon repeats): RULER's 30/3 with a 40-word 10/3 example from 4096 tokens on, 6/1 with a
    20-word 3/1 example below."""
    return (30, 3, 40, 10, 3) if context_tokens >= 4096 else (6, 1, 20, 3, 1)


def _pseudo_word(i: int) -> str:
    """Made-up three-syllable word number ``i`` (distinct for i below 343000)."""
    code = (i * 104729) % _PSEUDO_SPACE  # 104729 is prime, so this permutes 0.._PSEUDO_SPACE-1
    size = len(_SYLLABLES)
    return _SYLLABLES[code // size**2] + _SYLLABLES[code // size % size] + _SYLLABLES[code % size]


class _WordStream:
    """Words in the sample's order, then made-up words none of the real ones occurs in; prefix
    stable, so ``take(n)`` for a larger ``n`` extends the shorter list."""

    def __init__(self, words: list[str], offset: int):
        self._words, self._next = list(words), offset

    def take(self, n: int) -> list[str]:
        """The first ``n`` words."""
        while len(self._words) < n:
            word = _pseudo_word(self._next % _PSEUDO_SPACE)
            self._next += 1
            if not any(real in word for real in _WORDS):
                self._words.append(word)
        return self._words[:n]


def _numbered(words: list[str]) -> str:
    """"1. w 2. w ..." as in RULER's word list."""
    return " ".join(f"{i}. {w}" for i, w in enumerate(words, start=1))


def _cwe_prompt(numbered: str) -> str:
    """A common-words question about the numbered list, ending with its answer prefix."""
    return ("Below is a numbered list of words. In these words, some appear more often than "
            f"others. Memorize the ones that appear most often.\n{numbered}\nQuestion: What are "
            f"the {_CWE_COMMON} most common words in the above list? Answer: The top "
            f"{_CWE_COMMON} words that appear most often in the list are:")


def _cwe_task(rng: random.Random, context_tokens: int) -> _Task:
    """Draw the worked example and the 10 common words; filler units are uncommon words."""
    common_reps, other_reps, example_size, example_common, example_other = \
        _cwe_counts(context_tokens)
    order = rng.sample(_WORDS, len(_WORDS))
    example, order = order[:example_size], order[example_size:]
    common, stream = order[:_CWE_COMMON], _WordStream(order[_CWE_COMMON:],
                                                      rng.randrange(_PSEUDO_SPACE))
    example_list = (example[:_CWE_COMMON] * example_common
                    + example[_CWE_COMMON:] * example_other)
    rng.shuffle(example_list)
    shot = f"{_cwe_prompt(_numbered(example_list))} {_numbered(example[:_CWE_COMMON])}\n\n"

    def render(r: random.Random, n: int) -> _Layout:
        words = common * common_reps + stream.take(n) * other_reps
        r.shuffle(words)
        context = _numbered(words)
        return _Layout(shot + _cwe_prompt(context), context, n, tuple(words))

    return _Task(tuple(common), render)


# --------------------------------------------------------------------------------------------
# Frequent words extraction


_FWE_ALPHA = 2.0
_ZETA_ALPHA = math.pi**2 / 6  # Riemann zeta(2), the Zipf normaliser for alpha = 2
_FWE_ANSWERS = 3


def _fwe_counts(total: int, size: int) -> list[int]:
    """Occurrences of the coded words of rank 1..size: int(total * k**-alpha / zeta(alpha))."""
    return [int(total * k**-_FWE_ALPHA / _ZETA_ALPHA) for k in range(1, size + 1)]


def _fwe_prompt(context: str) -> str:
    """A frequent-words question about the coded text, ending with its answer prefix."""
    return ("Read the following coded text and track the frequency of each coded word. Find the "
            f"three most frequently appeared coded words.\n{context}\nQuestion: Do not provide "
            "any explanation. Please ignore the dots '...'. What are the three most frequently "
            "appeared words in the above coded text? Answer: According to the coded text above, "
            "the three most frequently appeared words are:")


def _fwe_task(rng: random.Random, context_tokens: int) -> _Task:
    """Draw the coded vocabulary (RULER: context // 50 six-letter words, rank 1 is the '...'
    noise); the answers are ranks 2-4 and the filler size is the Zipf total."""
    size = max(10, context_tokens // 50)
    vocab: list[str] = ["..."]
    while len(vocab) < size:
        word = "".join(rng.choices(string.ascii_lowercase, k=6))
        if word not in vocab:
            vocab.append(word)

    def render(r: random.Random, total: int) -> _Layout:
        words = [w for w, c in zip(vocab, _fwe_counts(total, size), strict=True)
                 for _ in range(c)]
        r.shuffle(words)
        context = " ".join(words)
        return _Layout(_fwe_prompt(context), context, total, tuple(words))

    def valid(total: int) -> bool:
        counts = _fwe_counts(total, size)[1 : _FWE_ANSWERS + 2]
        return all(a > b for a, b in pairwise(counts))

    return _Task(tuple(vocab[1 : _FWE_ANSWERS + 1]), render, valid=valid)
