"""Seed 004's adaptive tier boundaries run on a real model: do they converge, and how fast?
(issue 57; the seed's target: threshold convergence within 100 samples.)

Prefills ``--context`` tokens of the default book into seed 004's three tiers
(``quantizer=tiers``) with certificate-driven boundaries (``quantizer.adaptive``,
:mod:`certkv.cache.thresholds`: every ``window`` decode steps a layer moves its hot / stale ages
by what its certificates measured), then decodes ``--steps`` teacher-forced tokens of the same
book, certified, for each ``--window``. Every layer's decisions (step, promotion, dense and bound
rates, verdict, hot, stale) go to JSON; the markdown says per window after how many decode steps
(and decisions) each layer's boundaries last moved, how often a layer's verdict flipped between
"archive more" and "archive less", and where the boundaries ended; the figure draws hot and
stale against the decode step (median over layers, the range shaded).

    .venv/bin/python scripts/threshold_convergence.py --out reports/methods/thresholds_2k
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from pathlib import Path

import torch

from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.config import compose_config
from certkv.eval.decode import Method, Prefill
from certkv.eval.runner import build
from certkv.files import write_atomic


def tiers_with(window: int):
    """``quantizer=tiers`` with adaptive boundaries deciding every ``window`` steps."""
    cfg = compose_config(["quantizer=tiers", "+quantizer.adaptive._target_="
                          "certkv.cache.thresholds.AdaptiveThresholds",
                          f"+quantizer.adaptive.window={window}"])
    return build(cfg.quantizer, "quantizer")


def run_window(lm, ids: list[int], context: int, steps: int, window: int) -> dict:
    """Decode ``steps`` teacher-forced tokens after ``context`` prefilled ones; every layer's
    decisions."""
    method = Method.build("certified", "certified", quantizer=tiers_with(window))
    decoder = Prefill(lm, ids[:context - 1]).session(method).decoder()
    start = time.perf_counter()
    for token in ids[context - 1: context - 1 + steps]:
        decoder.step(token)
    seconds = time.perf_counter() - start
    layers = [layer.stores[0]._tracker.history for layer in decoder.cache.layers]
    return {"window": window, "steps": steps, "seconds": seconds, "layers": layers}


def settled(history: list[dict], start: list[int]) -> dict:
    """When a layer's boundaries last moved (decode step and decision count; 0: never), how
    often its verdict flipped between archiving more and less, and where they ended."""
    last_step, last_decision, ages = 0, 0, list(start)
    flips, previous = 0, None
    for i, d in enumerate(history, start=1):
        if [d["hot"], d["stale"]] != ages:
            last_step, last_decision, ages = d["step"], i, [d["hot"], d["stale"]]
        if d["verdict"] != "keep":
            flips += previous is not None and d["verdict"] != previous
            previous = d["verdict"]
    return {"last_move_step": last_step, "last_move_decision": last_decision, "flips": flips,
            "hot": ages[0], "stale": ages[1]}


def summary_rows(result: dict, start: list[int]) -> list[str]:
    rows = []
    for run in result["runs"]:
        done = [settled(h, start) for h in run["layers"]]
        decisions = len(run["layers"][0])
        moved = [d["last_move_step"] for d in done]
        still = sum(d["last_move_decision"] == decisions for d in done)
        verdicts = [d["verdict"] for h in run["layers"] for d in h]
        rows.append(
            f"| {run['window']} | {decisions} | {statistics.median(moved):.0f} | {max(moved)} | "
            f"{still} | {sum(d['flips'] for d in done)} | "
            f"{_range([d['hot'] for d in done])} | {_range([d['stale'] for d in done])} | "
            f"{verdicts.count('archive more')}/{verdicts.count('keep')}/"
            f"{verdicts.count('archive less')} |")
    return rows


def _range(xs: list[int]) -> str:
    return f"{min(xs)}-{max(xs)} (median {statistics.median(xs):.0f})"


def figure(result: dict, start: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(result["runs"]), figsize=(4.2 * len(result["runs"]), 3.2),
                             squeeze=False)
    for ax, run in zip(axes[0], result["runs"], strict=True):
        steps = [0] + [d["step"] for d in run["layers"][0]]
        for which, colour in (("hot", "tab:red"), ("stale", "tab:blue")):
            index = 0 if which == "hot" else 1
            series = [[start[index]] + [d[which] for d in h] for h in run["layers"]]
            per_step = list(zip(*series, strict=True))
            ax.fill_between(steps, [min(x) for x in per_step], [max(x) for x in per_step],
                            color=colour, alpha=0.2, step="post")
            ax.step(steps, [statistics.median(x) for x in per_step], where="post",
                    color=colour, label=f"{which} (median over layers, range shaded)")
        ax.set_yscale("log")
        ax.set_xlabel("decode step", fontsize=8)
        ax.set_ylabel("boundary age (tokens)", fontsize=8)
        ax.set_title(f"window {run['window']} steps", fontsize=9)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--window", type=int, action="append")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    windows = args.window or [25, 100]
    lm, _ = _decode_model(args.model, "auto", torch.device("cpu"), torch.float32)
    ids = _decode_prompt(lm, args.context + args.steps)
    runs = [run_window(lm, ids, args.context, args.steps, w) for w in windows]
    tiers = tiers_with(windows[0])
    start = [tiers.hot, tiers.stale]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    result = {"model": args.model, "context": args.context, "steps": args.steps,
              "start": start, "commit": commit, "threads": torch.get_num_threads(),
              "command": "scripts/threshold_convergence.py " + " ".join(
                  [f"--context {args.context}", f"--steps {args.steps}",
                   *(f"--window {w}" for w in windows), f"--out {args.out}"]),
              "runs": runs}
    args.out.mkdir(parents=True, exist_ok=True)
    write_atomic(args.out / "thresholds.json", json.dumps(result, indent=1) + "\n")
    figure(result, start, args.out / "thresholds.png")
    head = ["| window | decisions | last move (median step) | last move (max step) | layers "
            "moving at the last decision | verdict flips | hot at the end | stale at the end | "
            "more/keep/less |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    table = "\n".join(head + summary_rows(result, start))
    write_atomic(args.out / "thresholds.md", "\n\n".join([
        f"# Adaptive tier boundaries on {args.model} (seed 004)",
        f"Command: `{result['command']}`  \nCommit: `{commit}`  \nDevice: {platform()} "
        f"({torch.get_num_threads()} threads), torch {torch.__version__}",
        f"Prefill {args.context} tokens of the default book into `quantizer=tiers` with "
        f"`quantizer.adaptive` (start: hot {start[0]}, stale {start[1]} tokens), then "
        f"{args.steps} certified teacher-forced decode steps per window; every layer decides "
        "on its own.", "![thresholds](thresholds.png)", table,
        "last move: the decode step of a layer's last boundary change (0: never moved); layers "
        "moving at the last decision: not settled when the run ended; verdict flips: changes "
        "between archive more and archive less, over all layers; more/keep/less: the verdicts "
        "of every layer's decisions."]) + "\n")
    print(table)


def platform() -> str:
    import os
    import platform as p

    return f"CPU ({p.machine()}, {os.cpu_count()} cores)"


if __name__ == "__main__":
    main()
