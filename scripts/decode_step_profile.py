"""Where a whole-model decode step's time goes on a CPU, dense and certified in one process
(issue 55: the layer profile, :mod:`cpu_step_profile`, times one layer called again and again;
in the model each layer's step follows the layer before it and its MLP).

Each method decodes from its own prefill of the same book prompt, one step of each in turn;
every part is timed as the model calls it (its callers' share not counted again):

* the MLPs and the attention modules (projections, RoPE, the cache update, attention);
* in them, the cache update (dense: the model's own cache, which concatenates; certified: the
  store's append, with the block commits that quantize and annotate a completed block every
  ``B`` tokens) and the attention function (dense: SDPA; certified: the certified step and
  its certificate's logging);
* in the certified step, the compiled numba call (:mod:`certkv.kernels.numba_step`), the
  fallback (rungs 3-4, where a head needs dense attention) and the Python around them.

Means over ``--steps`` steps (48: each layer completes three blocks), since the block commits
fall on one step in ``B``; ``certkv bench decode`` reports medians.

    .venv/bin/python scripts/decode_step_profile.py [--context 4096 --context 8192]
        [--steps 48] [--model smollm2_135m] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AttentionInterface
from transformers.cache_utils import DynamicLayer

from certkv import CertifiedAttention
from certkv.bench import device_info
from certkv.bench.batch import BatchRun, batch_prompts
from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.bench.measure import timing_calls
from certkv.bench.tables import provenance, share_rows
from certkv.files import write_atomic
from certkv.kernels import numba_step
from certkv.models import hook
from certkv.models.tiered_layer import TieredLayer
from certkv.step import QuantizedStep

MODES = ("dense", "certified")

# (label, what the report calls it, depth in the report's outline)
PARTS = (("mlp", "MLPs", 0),
         ("attention_module", "attention modules (projections, RoPE, cache, attention)", 0),
         ("cache_update", "cache update (dense: concatenation; certified: append, commits)", 1),
         ("attention_function", "attention function (dense: SDPA; certified: the step, its log)",
          1),
         ("certified_step", "certified step, as the hook calls it", 2),
         ("compiled_call", "the compiled numba call", 3),
         ("fallback", "the fallback (rungs 3-4: dense heads over the FP16 originals)", 3),
         ("certificate_log", "certificate log (per layer; the step's summary at layer 0)", 2))


def _module_class(model: torch.nn.Module, suffix: str) -> type:
    """The class of ``model``'s first submodule whose class name ends with ``suffix``."""
    return next(type(m) for m in model.modules() if type(m).__name__.endswith(suffix))


@contextmanager
def _timed_attention_function(times: dict[str, list[float]]):
    """Within the block the registered ``certkv`` attention function appends its milliseconds
    per call to ``times["attention_function"]``."""
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return hook.certkv_attention(*args, **kwargs)
        finally:
            times.setdefault("attention_function", []).append(
                1e3 * (time.perf_counter() - start))

    AttentionInterface.register(hook.NAME, timed)
    try:
        yield
    finally:
        AttentionInterface.register(hook.NAME, hook.certkv_attention)


def profile(lm, context: int, steps: int) -> dict:
    """Per method: the mean milliseconds per decode step of the whole step and of each of
    :data:`PARTS` (0 where a method has none), over ``steps`` steps after 3 warm-up steps."""
    prompt = batch_prompts(_decode_prompt(lm, context + 97), context, 1)
    runs = {mode: BatchRun(lm, prompt, mode) for mode in MODES}
    owners = [(_module_class(lm.model, "MLP"), "forward", "mlp"),
              (_module_class(lm.model, "Attention"), "forward", "attention_module"),
              (DynamicLayer, "update", "cache_update"),
              (TieredLayer, "update", "cache_update"),
              (CertifiedAttention, "__call__", "certified_step"),
              (numba_step, "_step", "compiled_call"),
              (QuantizedStep, "_fallback", "fallback"),
              (TieredLayer, "record", "certificate_log")]
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
    whole: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(3):
        for run in runs.values():
            run.step()
    for _ in range(steps):
        for mode, run in runs.items():  # one step of each in turn
            with timing_calls(owners, times[mode]), _timed_attention_function(times[mode]):
                start = time.perf_counter()
                run.step()
                whole[mode].append(1e3 * (time.perf_counter() - start))
    return {mode: {"step": sum(whole[mode]) / steps,
                   **{label: sum(times[mode].get(label, [])) / steps for label, _, _ in PARTS}}
            for mode in MODES}


def _rows() -> list[tuple]:
    """The report's rows: the whole step, each part, what the step's parts leave."""
    def indent(depth: int) -> str:  # markdown tables drop leading spaces
        return "· " * depth + ("" if depth == 0 else "in it: ")

    rows = [("**whole decode step**", lambda r: r["step"])]
    for label, what, depth in PARTS:
        rows.append((indent(depth) + what, lambda r, label=label: r[label]))
        if label == "fallback":
            rows.append((indent(depth) + "Python around them (layout, arguments, certificate "
                         "objects)", lambda r: r["certified_step"] - r["compiled_call"]
                         - r["fallback"]))
    rows.append(("rest (embedding, norms, residuals, LM head, the decode loop)",
                 lambda r: r["step"] - r["mlp"] - r["attention_module"]))
    return rows


def render(results: list[dict], info: dict, command: str, model: str) -> str:
    """The report: one column per (context, method), with command, commit and machine."""
    columns = [r[mode] for r in results for mode in MODES]
    labels = [f"N={r['context']} {mode}" for r in results for mode in MODES]
    steps = results[0]["steps"]
    lines = [f"# Where a whole decode step's time goes ({model}, CPU)", "",
             *provenance(command, info, copy=True, threads=True), "",
             f"Means of {steps} decode steps per method after 3 warm-up steps, dense and "
             "certified one step each in turn, each from its own prefill of the same book "
             "prompt. %: share of the method's whole step. Each part is timed as the model "
             "calls it; an indented part is inside the one above it.", "",
             *share_rows(_rows(), columns, labels, lambda c: c["step"]), ""]
    for r in results:
        dense, cert = r["dense"], r["certified"]
        lines.append(
            f"N={r['context']}: certified / dense {cert['step'] / dense['step']:.2f}x (mean "
            f"step); attention functions {cert['attention_function']:.1f} against "
            f"{dense['attention_function']:.1f} ms, of which the compiled calls "
            f"{cert['compiled_call']:.1f} ms and the fallback {cert['fallback']:.1f} ms; "
            f"cache updates {cert['cache_update']:.1f} against {dense['cache_update']:.1f} ms.  ")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, action="append",
                        help="context tokens (repeat for several; default 4096)")
    parser.add_argument("--steps", type=int, default=48, help="timed decode steps per method")
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--out", type=Path, default=None,
                        help="write decode_step_profile.md and .json here")
    a = parser.parse_args(argv)
    contexts = a.context or [4096]
    if min(contexts) < 2 or a.steps < 1:
        parser.error("--context takes at least 2 tokens and --steps at least 1, e.g. "
                     "--context 4096 --steps 48")
    lm, weights = _decode_model(a.model, "auto", torch.device("cpu"), torch.float32)
    results = [{"context": n, "steps": a.steps, **profile(lm, n, a.steps)} for n in contexts]
    info = device_info()
    command = ("python scripts/decode_step_profile.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    text = render(results, info, command, f"{a.model}, {weights} weights")
    print(text)
    if a.out:
        write_atomic(a.out / "decode_step_profile.md", text)
        write_atomic(a.out / "decode_step_profile.json",
                     json.dumps({"command": command, **info, "results": results}, indent=2)
                     + "\n")


if __name__ == "__main__":
    main()
