"""How certkv's runs and kvpress's own process meet (issue 57, ``mode: kvpress``).

kvpress pins an older transformers than certkv needs (0.5.5: ``transformers<5.3``; certkv:
``>=5.17``), so its presses run in their own venv and process, and meet certkv's tasks through
files in the run directory (``kvpress/``):

1. ``certkv run`` writes, for every ``mode: kvpress`` variant's sample not yet recorded, the
   sample's prompt as token ids (``prompts.jsonl``, one line per task sample, shared by the
   variants) and its requests (``requests.jsonl``: the tokens fed after the prompt, the first
   decode token, the answer budget or the teacher-forced target, the press), with the model and
   the end-of-sequence ids in ``job.json``. It says what to run next.
2. ``bash scripts/kvpress/run.sh RUN_DIR`` makes kvpress's venv (``.venv-kvpress``, once) and
   runs ``scripts/kvpress/run_presses.py`` there: each prompt prefilled with the press as
   kvpress's pipeline does (``with press(model): model.model(context)``), then the requests'
   tokens decoded on the compressed cache with their true positions, greedy or teacher-forced,
   each question of a prompt on the same compressed prompt (the answer cut off after it, as
   kvpress's pipeline does). Answers go to ``answers.jsonl``, a line per finished sample; a
   rerun goes on where it stopped.
3. ``certkv run`` again (the same command: it resumes) scores the answers with the task's own
   scorer and records them beside certkv's variants, on the same prompts, with the versions
   that made them.

The prompts are certkv's token ids (the two transformers versions tokenize the default model's
text differently). ``T1 / FP16`` of a kvpress record is the share of the prompt's tokens its
cache kept (FP16 keys and values: the same share of bytes). Step times are measured in
kvpress's own process and venv: the reports show them but do not set them against certkv's.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict
from pathlib import Path

from certkv.errors import ConfigError, require
from certkv.eval.batch import Answer
from certkv.eval.decode import certificate_record
from certkv.eval.press import KVPress
from certkv.files import write_atomic

FOLDER = "kvpress"  # in the run directory
SCRIPT = "scripts/kvpress/run.sh"


def _key(task: str, sample: int, variant: str) -> str:
    return f"{task}/{sample}/{variant}"


def read_lines(path: Path) -> list[dict]:
    """A JSONL file's records; a last line cut short by an interrupted writer is left out."""
    if not path.exists():
        return []
    out = []
    lines = path.read_text().splitlines()
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            require(i == len(lines) - 1, ConfigError,
                    f"{path} line {i + 1} is not JSON; remove it (the run that wrote it will "
                    "redo that sample).")
    return out


class Exchange:
    """The files through which a run and kvpress's process meet (``RUN_DIR/kvpress/``)."""

    def __init__(self, run_dir: str | Path) -> None:
        self.root = Path(run_dir) / FOLDER
        self.answers = {a["key"]: a for a in read_lines(self.root / "answers.jsonl")}
        self._prompts = {p["key"] for p in read_lines(self.root / "prompts.jsonl")}
        self._requests = {r["key"] for r in read_lines(self.root / "requests.jsonl")}
        self.pending = 0  # samples asked of kvpress and not answered yet, this session

    def write_job(self, job: dict) -> None:
        """What kvpress's process needs besides the prompts: ``model`` (certkv's ModelSpec
        fields), ``stop_ids`` (end-of-sequence ids), ``threads`` (CPU threads, or None) and
        ``command`` (the run's command, which scores the answers)."""
        self.root.mkdir(parents=True, exist_ok=True)
        write_atomic(self.root / "job.json", json.dumps(job, indent=2) + "\n")

    def answered(self, task: str, sample, variant: str) -> dict | None:
        return self.answers.get(_key(task, sample.index, variant))

    def ask(self, task: str, sample, variant: str, press: KVPress, requests: list) -> None:
        """Write ``sample``'s prompt (once per task sample) and ``variant``'s requests of it
        (once), for kvpress's process."""
        self.pending += 1
        self.root.mkdir(parents=True, exist_ok=True)
        prompt = f"{task}/{sample.index}"
        if prompt not in self._prompts:
            _append(self.root / "prompts.jsonl", {"key": prompt, "prefix": sample.prefix})
            self._prompts.add(prompt)
        key = _key(task, sample.index, variant)
        if key not in self._requests:
            asked = [{"feed": list(r.feed), "first": r.first,
                      "max_new_tokens": r.max_new_tokens, "target": list(r.target)}
                     for r in requests]
            _append(self.root / "requests.jsonl",
                    {"key": key, "prompt": prompt, "press": asdict(press), "requests": asked})
            self._requests.add(key)

    def message(self, out_dir: str, command: str) -> str | None:
        """The sentence that says what to run while kvpress answers are missing."""
        if not self.pending:
            return None
        return (f"{self.pending} kvpress record(s) wait for kvpress's own run: "
                f"bash {SCRIPT} {shlex.quote(str(out_dir))}, then rerun `{command}` to score "
                "them (it resumes).")


def _append(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


class Answered:
    """A kvpress sample's answers as a session of the protocol gives them to the runner's
    record: its decode step times and a certificate record with no steps (nothing is
    certified) whose ``tier1_over_dense`` is the share of the prompt's tokens kept."""

    def __init__(self, found: dict) -> None:
        self.found = found
        self.answers = [Answer(a["tokens"], a["logprobs"], a["greedy"], 1)
                        for a in found["answers"]]
        self.step_ms = [ms for a in found["answers"] for ms in a["step_ms"]]

    def telemetry(self) -> list:
        return []

    def certificate_record(self) -> dict:
        record = certificate_record([])
        record["tier1_over_dense"] = self.found["kept_tokens"] / max(self.found["prompt_tokens"],
                                                                     1)
        return record

    def provenance(self) -> dict:
        """The versions that made the answers (kvpress, transformers, torch)."""
        return {"external": self.found.get("env", {})}
