"""certkv's own tasks as offline lm-eval YAML tasks over generated local JSONL.

:func:`write_tasks` writes, for one context length, a folder that lm-eval reads with
``--include_path`` (``certkv lm-eval`` adds it for you):

* ``certkv_ruler_<subtask>`` (``generate_until``), grouped as ``certkv_ruler``: RULER's seven
  default subtasks from :mod:`certkv.eval.ruler`, scored by RULER's own rule (the fraction of
  required references in the answer, case-insensitive);
* ``certkv_niah`` (``generate_until``): the paper's ten-needle NIAH, one row per needle's
  question after its trial's document; accuracy = the fraction of needles retrieved;
* ``certkv_needle_choice`` (``multiple_choice``, i.e. ``loglikelihood``): RULER's single-needle
  prompt, the right value among three values of other samples;
* ``certkv_books`` (``loglikelihood_rolling``): non-overlapping windows of the offline books,
  word / byte perplexity and bits per byte.

Prompts are built with the evaluated model's tokenizer, so the context is measured in its
tokens; everything is deterministic per (context, sample), and no network is needed.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from certkv.errors import CertKVError, ConfigError, require
from certkv.files import data_dir, write_atomic

SUBTASKS = ("niah_single", "niah_multikey", "niah_multivalue", "niah_multiquery", "vt", "cwe",
            "fwe")
TASKS = (*[f"certkv_ruler_{s}" for s in SUBTASKS], "certkv_niah", "certkv_needle_choice",
         "certkv_books")

_UTILS = '''"""Scoring of certkv's lm-eval tasks (written by certkv.integrations.lm_eval_tasks)."""
from certkv.integrations.lm_eval_tasks import process_niah, process_ruler  # noqa: F401
'''


def process_ruler(doc: dict, results: list[str]) -> dict:
    """lm-eval ``process_results`` of a RULER task: RULER's rule on the generation."""
    from certkv.eval.ruler import RulerSample, score

    sample = RulerSample(doc["subtask"], 0, 0, "", tuple(doc["answers"]), 0, doc["metric"], 0)
    return {"score": score(sample, results[0])}


def process_niah(doc: dict, results: list[str]) -> dict:
    """lm-eval ``process_results`` of the ten-needle NIAH: the needle's value found or not."""
    from certkv.eval.niah import score

    return {"acc": score(doc["answer"], results[0])}


def _niah_rows(tokenizer, context: int, trials: int, book: str) -> list[dict]:
    """The paper's ten-needle NIAH: one document per trial, one row per needle's question."""
    from certkv.eval.corpora import book_text
    from certkv.eval.niah import make_multi_needle_trials

    rows = []
    for t in make_multi_needle_trials(tokenizer, book_text(book), context, trials):
        rows += [{"trial": t.index, "needle": j, "input": t.document + q, "answer": a}
                 for j, (q, a) in enumerate(zip(t.questions, t.answers, strict=True))]
    return rows


def _yaml(fields: dict) -> str:
    """YAML text of ``fields`` (json is YAML; ``!function`` tags are written verbatim)."""
    lines = []
    for key, value in fields.items():
        text = value if isinstance(value, str) and value.startswith("!function") \
            else json.dumps(value)
        lines.append(f"{key}: {text}")
    return "\n".join(lines) + "\n"


def _data(folder: Path, name: str, rows: list[dict]) -> dict:
    path = folder / f"{name}.jsonl"
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return {"dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(path)}},
            "test_split": "test"}


def _ruler_rows(tokenizer, subtask: str, context: int, samples: int, book: str) -> list[dict]:
    from certkv.eval.ruler import make_sample

    rows = []
    for i in range(samples):
        s = make_sample(tokenizer, subtask, context, i, book)
        rows.append({"subtask": subtask, "input": s.prompt, "answers": list(s.answers),
                     "metric": s.metric, "max_new_tokens": s.max_new_tokens})
    return rows


def _choice_rows(single: list[dict]) -> list[dict]:
    """Single-needle prompts with the right value and three wrong ones: other samples' values,
    then random numbers of the same length (deterministic per sample)."""
    rows = []
    for i, row in enumerate(single):
        right, rng = row["answers"][0], random.Random(i)
        wrong = list(dict.fromkeys(r["answers"][0] for r in single if r["answers"][0] != right))
        while len(wrong) < 3:
            fake = "".join(rng.choice("0123456789") for _ in right)
            if fake != right and fake not in wrong:
                wrong.append(fake)
        choices = [right, *wrong[:3]]
        rng.shuffle(choices)
        rows.append({"input": row["input"], "choices": [f" {c}" for c in choices],
                     "gold": choices.index(right)})
    return rows


def _book_rows(tokenizer, context: int, windows: int) -> list[dict]:
    """The first ``windows`` non-overlapping windows of ``context`` tokens, book after book."""
    from certkv.eval.corpora import available_books, book_text

    rows = []
    for book in available_books():
        ids = tokenizer.encode(book_text(book), add_special_tokens=False)
        for start in range(0, len(ids) - context + 1, context):
            if len(rows) == windows:
                return rows
            rows.append({"book": book, "text": tokenizer.decode(ids[start:start + context])})
    return rows


class _Fit:
    """Builds each task's rows at the requested context and collects the tasks that do not fit
    with the smallest context each needs (searched to within 64 tokens), so one error names
    them all and the smallest context that works for every task."""

    def __init__(self, context: int, fix: str) -> None:
        self.context, self.fix, self.misfits = context, fix, {}

    def rows(self, task: str, make) -> list[dict]:
        """``make(context)``, or ``[]`` with ``task`` recorded as a misfit."""
        try:
            return make(self.context)
        except CertKVError:
            self.misfits[task] = _smallest_context(task, make, self.context)
            return []

    def check(self) -> None:
        """One :class:`ConfigError` naming every misfit, in the caller's syntax ``fix``."""
        if self.misfits:
            need = max(self.misfits.values())
            tasks = ", ".join(f"{t} (needs {n})" for t, n in self.misfits.items())
            verb = "does" if len(self.misfits) == 1 else "do"
            raise ConfigError(f"{tasks} {verb} not fit in {self.context} tokens (question, payload "
                              f"and answer); use {self.fix.replace('...', str(need))} or more.")


def _smallest_context(task: str, make, context: int) -> int:
    """The smallest context (to within 64 tokens) at which ``make`` succeeds."""
    def fits(n: int) -> bool:
        try:
            make(n)
            return True
        except CertKVError:
            return False
    low, high = context, max(2 * context, 1024)
    while not fits(high):
        require(high < 1 << 17, ConfigError,
                f"the task {task} cannot be built at any context up to {high} tokens.")
        low, high = high, 2 * high
    while high - low > 64:
        mid = (low + high) // 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return high


def write_tasks(folder: str | Path, tokenizer, context: int = 4096, samples: int = 5,
                windows: int = 3, book: str = "emma", book_tokens: int | None = None,
                fix: str = "context=...") -> Path:
    """Write the task folder (JSONL data, YAML configs, the scoring module); returns it.
    ``context``: RULER prompt length in tokens (about 1024 at least: CWE's payload alone takes
    about 700; a task that does not fit names the smallest context that works, as ``fix``
    writes it); ``book_tokens``: the perplexity windows' length (default ``context``)."""
    from certkv.eval.corpora import book_text

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / "certkv_lm_eval_utils.py", _UTILS)
    haystack = book_text(book)
    fit = _Fit(context, fix)
    ruler = {s: fit.rows(f"certkv_ruler_{s}",
                         lambda n, s=s: _ruler_rows(tokenizer, s, n, samples, haystack))
             for s in SUBTASKS}
    niah = fit.rows("certkv_niah", lambda n: _niah_rows(tokenizer, n, samples, book))
    fit.check()
    for subtask, rows in ruler.items():
        name = f"certkv_ruler_{subtask}"
        write_atomic(folder / f"{name}.yaml", _yaml({
            "task": name, **_data(folder, name, rows), "output_type": "generate_until",
            "doc_to_text": "{{input}}", "doc_to_target": "{{answers[0]}}",
            "generation_kwargs": {"until": [], "max_gen_toks": rows[0]["max_new_tokens"],
                                  "do_sample": False},
            "process_results": "!function certkv_lm_eval_utils.process_ruler",
            "metric_list": [{"metric": "score", "aggregation": "mean",
                             "higher_is_better": True}]}))
    write_atomic(folder / "certkv_ruler.yaml", _yaml({
        "group": "certkv_ruler", "task": [f"certkv_ruler_{s}" for s in SUBTASKS],
        "aggregate_metric_list": [{"metric": "score", "aggregation": "mean",
                                   "weight_by_size": False}]}))
    write_atomic(folder / "certkv_niah.yaml", _yaml({
        "task": "certkv_niah", **_data(folder, "certkv_niah", niah),
        "output_type": "generate_until", "doc_to_text": "{{input}}",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": [], "max_gen_toks": 16, "do_sample": False},
        "process_results": "!function certkv_lm_eval_utils.process_niah",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    write_atomic(folder / "certkv_needle_choice.yaml", _yaml({
        "task": "certkv_needle_choice",
        **_data(folder, "certkv_needle_choice", _choice_rows(ruler["niah_single"])),
        "output_type": "multiple_choice", "doc_to_text": "{{input}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]}))
    write_atomic(folder / "certkv_books.yaml", _yaml({
        "task": "certkv_books", **_data(folder, "certkv_books",
                                        _book_rows(tokenizer, book_tokens or context, windows)),
        "output_type": "loglikelihood_rolling", "doc_to_text": "", "doc_to_target": "{{text}}",
        "metric_list": [{"metric": m} for m in ("word_perplexity", "byte_perplexity",
                                                  "bits_per_byte")]}))
    return folder


def task_folder(model: str, context: int = 4096, samples: int = 5,
                fix: str = "--certkv_context ...") -> Path:
    """The task folder for ``model``'s tokenizer (written once under ``$CERTKV_DATA``); ``fix``
    is how the caller sets the context (named when a task does not fit)."""
    from certkv.integrations.lm_eval_args import model_spec
    from certkv.models.loading import load_tokenizer

    require(isinstance(context, int) and context > 0 and isinstance(samples, int)
            and samples > 0, ConfigError,
            f"context={context!r} and samples={samples!r} must be positive integers, e.g. "
            f"{fix.replace('...', '4096')}.")
    spec = model_spec(model)
    source = f"-{hashlib.md5(str(spec.path).encode()).hexdigest()[:8]}" if spec.path else ""
    folder = data_dir() / "lm_eval_tasks" / f"{spec.name}{source}_{context}_{samples}"
    if not all((folder / f"{name}.yaml").exists() for name in (*TASKS, "certkv_ruler")):
        write_tasks(folder, load_tokenizer(spec), context, samples, fix=fix)
    return folder
