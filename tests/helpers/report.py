"""Hand-made run directories with known answers, as `certkv run` writes them (test_report.py,
test_readable.py)."""

from __future__ import annotations

import itertools
import json

import yaml

STEP = {"e_key_step_mean": [0.01, 0.02], "e_key_step_max": [0.1, 0.2],
        "e_val_step_mean": [0.03, 0.04], "e_val_step_max": [0.3, 0.4],
        "e_arith_step_mean": [1e-3, 2e-3], "e_arith_step_max": [1e-2, 2e-2],
        "bound_step_mean": [0.05, 0.06], "bound_step_max": [0.5, 0.6],
        "candidate_e_key_step_mean": [0.01, 0.02], "candidate_e_key_step_max": [0.1, 0.2],
        "candidate_e_val_step_mean": [0.03, 0.04], "candidate_e_val_step_max": [0.3, 0.4],
        "steps": 2, "head_steps": 20, "rung0": 10, "rung1": 2, "rung2": 6, "rung3": 2,
        "rung4": 0, "ranking_fail": 1, "boundary_fail": 1, "canary_fail": 0,
        "value_promotions": 4, "k_star_mean": 3.0, "tier1_over_dense": 0.56,
        "scratch_hit_rate": 0.5, "h2d_bytes": 2**20, "device_bytes": 1, "tier2_bytes": 1,
        "dense_bytes": 2}
NO_STEPS = {"steps": 0, "head_steps": 1, **{f"rung{k}": 0 for k in range(5)},
            "ranking_fail": 0, "boundary_fail": 0, "canary_fail": 0, "value_promotions": 0,
            "k_star_mean": 0.0, "tier1_over_dense": 0.0, "scratch_hit_rate": 0.0,
            "h2d_bytes": 0}


def write_run(root, experiment, samples, variants=("dense", "certified"), certs=None):
    """A run directory as `certkv run` writes it (config, run.json, JSONL records); without
    ``certs``, every method's certificate records are :data:`STEP`."""
    root.mkdir(parents=True)
    modes = {v: "dense" if v == "dense" else "certified" for v in variants}
    config = {"experiment": experiment, "model": {"name": "toy"},
              "task": {"ruler": {"context": 4096}, "niah": {"context": 4096},
                       "perplexity": {"context": 4096}},
              "variants": [{"name": v, "mode": modes[v]} for v in variants]}
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    (root / "run.json").write_text(json.dumps({"experiment": experiment, "model": "toy",
                                               "command": "certkv run", "commit": "abc",
                                               "threads": 2, "wall_s": 60.0}))
    certs = certs or [{"task": s["task"], "sample": s["sample"], "variant": s["variant"],
                       **(NO_STEPS if s["variant"] == "dense" else STEP)} for s in samples]
    for name, rows in (("samples.jsonl", samples), ("certificates.jsonl", certs)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def rec(task, sample, variant, **fields):
    return {"task": task, "sample": sample, "variant": variant,
            "mode": "dense" if variant == "dense" else "certified", "decode_steps": 2,
            "ms_per_step": 10.0 if variant == "dense" else 25.0, **fields}


def ruler_run(tmp_path, drop_last=False):
    """2 slices x 2 subtasks; certified misses one vt answer in slice 1."""
    samples = []
    for slice_ in range(2):
        for j, subtask in enumerate(("niah_single", "vt")):
            index = 2 * slice_ + j
            for variant in ("dense", "certified"):
                score = 0.0 if (variant, slice_, subtask) == ("certified", 1, "vt") else 1.0
                samples.append(rec("ruler", index, variant, subtask=subtask, slice=slice_,
                                   score=score, **{"pass": score == 1.0}))
    if drop_last:
        samples = samples[:-1]  # a partial run: the last sample of certified is missing
    return write_run(tmp_path / "ruler_4k", "ruler_4k", samples)


SUBTASKS = ("niah_single", "vt", "cwe")


def _scaled_certificate(k: int, audited: bool) -> dict:
    """Method ``k``'s certificate record: :data:`STEP` with its terms times ``k``, E_key zero
    for k = 2 (a term zero at every step), the actual error (a tenth of the bound) when
    ``audited``, and no head-step on rung 4."""
    cert = {key: [k * x for x in value] if isinstance(value, list) else value
            for key, value in STEP.items()}
    if k == 2:
        cert["e_key_step_mean"], cert["e_key_step_max"] = [0.0, 0.0], [0.0, 0.0]
    if audited:
        cert.update(audited=True, violations=0,
                    error_step_mean=[x / 10 for x in cert["bound_step_mean"]],
                    error_step_max=[x / 10 for x in cert["bound_step_max"]])
    return cert


def many_methods_run(tmp_path, methods=24, audited=(1, 3)):
    """Dense and ``methods`` methods (``method-01``...) on RULER (3 subtasks x 2 slices;
    method-01 scores 0 on vt), ten-needle NIAH and two perplexity windows, with certificates
    that differ per method (``audited`` methods carry the audit's actual error)."""
    variants = ["dense", *[f"method-{k:02d}" for k in range(1, methods + 1)]]
    samples, certs = [], []
    for k, v in enumerate(variants):
        for i, (slice_, subtask) in enumerate(itertools.product(range(2), SUBTASKS)):
            score = 0.0 if (k, subtask) == (1, "vt") else 1.0 - (k % 4) / 4
            samples.append(rec("ruler", i, v, subtask=subtask, slice=slice_,
                               score=score, **{"pass": score == 1.0}))
        samples.append(rec("niah", 0, v, accuracy=0.5, retrieved=[
            int((d + k) % 3 == 0) for d in range(10)], **{"pass": True}))
        for window in range(2):
            samples.append(rec("perplexity", window, v, nll=1.0, tokens=100,
                               ppl=10.0 + 0.1 * k * (window + 1), document="emma"))
        cert = NO_STEPS if v == "dense" else _scaled_certificate(k, k in audited)
        certs += [{"task": t, "sample": 0, "variant": v, **cert} for t in ("ruler", "niah")]
    return write_run(tmp_path / "many", "many", samples, variants, certs)
