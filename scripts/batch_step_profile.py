"""Where a batch decode step's time goes (issue 54): certified decode steps of the whole model
over batches of sequences (as ``certkv bench decode --batch`` runs them), split by timing the
functions each step calls, so that batch 1 and batch B can be compared part by part.

Each batch holds book prompts from ``N`` tokens down to ``3N/4``, prefilled one by one and
joined for the decode steps (:class:`certkv.bench.batch.BatchRun`). Timed per step: the
compiled numba steps (one call per sequence and layer), the certified steps around them (the
layout, arguments, result objects, scratch counters and certificate of each (sequence, layer)
step), the appends of the new tokens (block completions apart), the certificate bookkeeping
(logs, the stores' observations), the model's linear layers, and the rest of the model.

    .venv/bin/python scripts/batch_step_profile.py [--context 2048] [--batch 1 --batch 8]
        [--steps 8] [--weights auto|random] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from certkv.attention import CertifiedAttention
from certkv.bench import device_info
from certkv.bench.batch import BatchRun, batch_prompts
from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.bench.measure import timing_calls
from certkv.bench.tables import provenance, share_rows
from certkv.cache.store import TieredKVStore
from certkv.files import write_atomic
from certkv.kernels import numba_step
from certkv.models.tiered_layer import TieredLayer

# (owner, function, label): what each step is split into (a label counts outermost calls only)
TIMED = ((numba_step, "_step", "compiled"), (CertifiedAttention, "_step", "steps"),
         (TieredKVStore, "append", "append"), (TieredKVStore, "_commit_blocks", "completions"),
         (TieredLayer, "record", "bookkeeping"), (TieredLayer, "record_batch", "bookkeeping"),
         (torch.nn.Linear, "forward", "linear"))
ROWS = (("**a decode step of the batch**", "total"),
        ("compiled numba steps (one per sequence and layer)", "compiled"),
        ("the rest of each (sequence, layer) step: layout, arguments, results, certificate, "
         "fallback", "python"),
        ("appends of the new tokens, block completions apart", "appends"),
        ("block completions (codes, annotations, tables)", "completions"),
        ("certificate bookkeeping (logs, the stores' observations)", "bookkeeping"),
        ("the model's linear layers", "linear"),
        ("the rest of the model (norms, RoPE, activations, the hook)", "rest"))


def profile(lm, text: list[int], context: int, batch: int, steps: int) -> dict:
    """Per-step milliseconds of each part (:data:`ROWS`) over ``steps`` certified steps of a
    batch of ``batch`` prompts (two warm-up steps first), and the calls counted."""
    run = BatchRun(lm, batch_prompts(text, context, batch), "certified")
    run.step(), run.step()
    times: dict[str, list[float]] = {}
    with timing_calls(list(TIMED), times):
        start = time.perf_counter()
        for _ in range(steps):
            run.step()
        total = 1e3 * (time.perf_counter() - start) / steps
    per_step = {label: sum(times.get(label, [])) / steps for _, _, label in TIMED}
    ms = {"total": total, "compiled": per_step["compiled"],
          "python": per_step["steps"] - per_step["compiled"],
          "appends": per_step["append"] - per_step["completions"],
          "completions": per_step["completions"], "bookkeeping": per_step["bookkeeping"],
          "linear": per_step["linear"]}
    ms["rest"] = total - per_step["steps"] - per_step["append"] - ms["bookkeeping"] - ms["linear"]
    calls = {label: len(times.get(label, [])) / steps for _, _, label in TIMED}
    return {"context": context, "batch": batch, "steps": steps, "ms": ms, "calls": calls,
            "per_sequence_layer_ms": ms["python"] / max(calls["steps"], 1)}


def render(results: list[dict], info: dict, command: str, weights: str) -> str:
    """The report: each batch's split as two columns (ms per step, % of the step) of one
    markdown table, with command, commit and machine."""
    lines = ["# Where a batch decode step's time goes (SmolLM2-135M, certified, CPU)", "",
             *provenance(command, info, threads=True, extra=f"; {weights} weights"), "",
             f"Per decode step (the mean of {results[0]['steps']} steps after 2 warm-up steps, "
             "each part timed around the functions it calls, outermost calls only). %: share of "
             "the step.", "",
             *share_rows([(name, lambda r, k=key: r["ms"][k]) for name, key in ROWS], results,
                         [f"N={r['context']} B={r['batch']}" for r in results],
                         lambda r: r["ms"]["total"], digits=1), ""]
    for r in results:
        calls = r["calls"]
        lines.append(f"N={r['context']} B={r['batch']}: {calls['steps']:.0f} certified steps "
                     f"and {calls['compiled']:.0f} compiled calls a decode step, "
                     f"{calls['completions']:.1f} block completions; the rest of each "
                     f"(sequence, layer) step {r['per_sequence_layer_ms']:.3f} ms.  ")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=2048,
                        help="tokens of the longest prompt (the shortest: 3/4 of it)")
    parser.add_argument("--batch", type=int, action="append",
                        help="sequences in a batch (repeat for several; default 1 and 8)")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per batch")
    parser.add_argument("--weights", choices=("auto", "real", "random"), default="auto")
    parser.add_argument("--out", type=Path, default=None,
                        help="write batch_step_profile.md and .json here")
    a = parser.parse_args(argv)
    batches = a.batch or [1, 8]
    if a.context < 8 or min(batches) < 1 or a.steps < 1:
        parser.error("--context takes at least 8 tokens, --batch and --steps positive numbers, "
                     "e.g. --context 2048 --batch 1 --batch 8")
    torch.manual_seed(0)
    lm, used = _decode_model("smollm2_135m", a.weights, torch.device("cpu"), torch.float32)
    text = _decode_prompt(lm, a.context + 97 * max(batches))
    results = []
    for b in batches:
        print(f"batch {b}: prefill of {b} prompts, then {a.steps + 2} decode steps",
              file=sys.stderr)
        results.append(profile(lm, text, a.context, b, a.steps))
    info = device_info()
    command = ("python scripts/batch_step_profile.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    report = render(results, info, command, used)
    print(report)
    if a.out:
        write_atomic(a.out / "batch_step_profile.md", report)
        write_atomic(a.out / "batch_step_profile.json",
                     json.dumps({"command": command, **info, "weights": used,
                                 "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
