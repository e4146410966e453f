"""Run an experiment: every task sample x every method variant, resumable.

For each sample the prompt is prefilled once with dense attention; each variant then decodes on
its own copy of the cache (:meth:`TieredCache.clone_as`). Results go to the run directory
(:class:`RunDir`) as they finish; a rerun skips what is recorded.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from certkv.attention import MODES, CertifiedAttention
from certkv.cache.hf import CacheSpec, TieredCache
from certkv.errors import ConfigError, require
from certkv.eval.decode import Decoder, prefill
from certkv.eval.results import RunDir
from certkv.models.loading import load_model
from certkv.quant import KVQuantizer

COMPONENTS = ("quantizer", "selector", "value_policy", "ladder")


@dataclass
class Variant:
    """One method compared in a run."""

    name: str
    mode: str
    attention: CertifiedAttention
    quantizer: KVQuantizer


def build_variants(cfg: DictConfig) -> list[Variant]:
    """Instantiate ``cfg.variants``: each entry overrides fields of the component groups."""
    variants, names = [], set()
    backend = instantiate(cfg.backend)
    for entry in cfg.variants:
        name, mode = entry.get("name"), entry.get("mode", "certified")
        require(name is not None and name not in names, ConfigError,
                f"every variant needs a unique name (got {name!r}); fix the variants list.")
        require(mode in MODES, ConfigError,
                f"variant {name!r} has mode={mode!r}; use one of {list(MODES)}.")
        unknown = set(entry) - {"name", "mode", *COMPONENTS}
        require(not unknown, ConfigError,
                f"variant {name!r} has unknown keys {sorted(unknown)}; it may set name, mode and "
                f"{', '.join(COMPONENTS)}.")
        parts = {c: instantiate(OmegaConf.merge(cfg[c], entry.get(c, {}))) for c in COMPONENTS}
        quantizer = parts["quantizer"].for_mode(mode)
        attention = CertifiedAttention(parts["selector"], parts["value_policy"], parts["ladder"],
                                       backend, mode, compile=cfg.get("compile"))
        variants.append(Variant(name, mode, attention, quantizer))
        names.add(name)
    return variants


def certificate_record(cache: TieredCache) -> dict:
    """Per-step certificate telemetry of one sample and variant (paper Tables 11, 12, 15)."""
    steps = cache.log.steps
    heads = sum(s["heads"] for s in steps) or 1
    stats = cache.scratch_stats()
    sizes = cache.bytes()
    record = {"steps": len(steps), "head_steps": heads,
              "tier1_over_dense": sizes["tier1"] / max(sizes["dense"], 1),
              "device_bytes": sizes["device"], "tier2_bytes": sizes["tier2"],
              "dense_bytes": sizes["dense"], "scratch_hit_rate": stats.hit_rate,
              "h2d_bytes": stats.h2d_bytes}
    for name in ("e_key", "e_val", "e_arith", "bound", "candidate_e_key", "candidate_e_val"):
        record[f"{name}_step_mean"] = [s[f"{name}_mean"] for s in steps]
        record[f"{name}_step_max"] = [s[f"{name}_max"] for s in steps]
    for rung in range(5):
        record[f"rung{rung}"] = sum(s[f"rung{rung}"] for s in steps)
    for name in ("ranking_fail", "boundary_fail", "canary_fail", "value_promotions"):
        record[name] = sum(s[name] for s in steps)
    record["k_star_mean"] = statistics.fmean(s["k_star_mean"] for s in steps) if steps else 0.0
    return record


def run_experiment(cfg: DictConfig, out_dir: str, progress: bool = True) -> dict:
    """Run every task sample x variant not yet recorded in ``out_dir``; returns the summary."""
    from certkv.report.summary import summarize

    run = RunDir(out_dir)
    run.write_config(OmegaConf.to_yaml(cfg, resolve=True))
    torch.manual_seed(cfg.seed)
    variants = build_variants(cfg)
    spec: CacheSpec = instantiate(cfg.cache)
    block_size = variants[0].quantizer.block_size
    tasks = [instantiate(node) for node in cfg.task.values()]
    lm = load_model(instantiate(cfg.model))
    plan = [(task, s) for task in tasks for s in task.samples(lm.tokenizer, lm.max_context)]
    columns = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=not progress) as bar:
        job = bar.add_task("samples x methods", total=len(plan) * len(variants))
        for task, sample in plan:
            todo = [v for v in variants if not run.done(task.name, sample.index, v.name)]
            bar.advance(job, len(variants) - len(todo))
            if not todo:
                continue
            base = prefill(lm, sample.prefix, block_size, spec)
            for variant in todo:
                bar.update(job, description=f"{task.name} #{sample.index} {variant.name}")
                _run_one(run, lm, task, sample, variant, base, spec)
                bar.advance(job)
    summary = summarize(run.samples, run.certificates, tasks, variants, cfg)
    run.write_summary(summary)
    return summary


def _run_one(run: RunDir, lm, task, sample, variant: Variant, base: TieredCache,
             spec: CacheSpec) -> None:
    cache = base.clone_as(variant.attention, variant.quantizer, spec)
    decoder = Decoder(lm, cache)
    metrics = task.evaluate(decoder, sample)
    cache.log.flush()
    key = {"task": task.name, "sample": sample.index, "variant": variant.name}
    ms = decoder.step_ms
    record = {**key, "mode": variant.mode, **metrics, **sample.meta, "decode_steps": len(ms),
              "ms_per_step": statistics.median(ms) if ms else 0.0}
    heads = [{**key, **h} for h in cache.log.heads] if spec.records == "full" else None
    run.add(record, {**key, **certificate_record(cache)}, heads)
