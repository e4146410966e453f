"""Run an experiment: every task sample x every method variant, resumable.

For each sample the prompt is prefilled once with dense attention (the model's own cache); each
variant then decodes on its own copy (:mod:`certkv.eval.decode`: the protocol's public API).
Results go to the run directory (:class:`RunDir`) as they finish; a rerun skips what is
recorded.
"""

from __future__ import annotations

import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from pathlib import Path

import torch
from hydra.errors import InstantiationException
from hydra.utils import get_class, instantiate
from omegaconf import DictConfig, OmegaConf

from certkv.attention import CertifiedAttention
from certkv.config import check_types
from certkv.errors import CertKVError, ConfigError, require
from certkv.eval.batch import answer_all
from certkv.eval.decode import (
    EVAL_MODES,
    FOREIGN_MODES,
    Method,
    Prefill,
    attention_mode,
    end_of_sequence_ids,
)
from certkv.eval.feasible import check_batch_memory, check_budget
from certkv.eval.hf_quantized import MODE as HF_MODE
from certkv.eval.hf_quantized import HFQuantized
from certkv.eval.kvpress_exchange import Answered, Exchange
from certkv.eval.press import MODE as PRESS_MODE
from certkv.eval.press import KVPress
from certkv.eval.progress import RunProgress, announce_compile
from certkv.eval.results import RunDir, read_jsonl
from certkv.files import exclusive_dir
from certkv.graphs import GraphedAttention
from certkv.models.hf_cache import CacheSpec
from certkv.models.loading import ModelSpec, check_source, load_model
from certkv.provenance import environment

COMPONENTS = ("quantizer", "selector", "value_policy", "ladder", "protect", "evict")
COUNT_FIELDS = ("slices", "trials", "windows")  # more or fewer samples of the same kind
# a task's settings that change how fast its records come, never what they hold
SPEED_FIELDS = ("batch_size",)
Variant = Method  # a run's variants are protocol methods built from the config


def build(node, path: str):
    """``instantiate(node)`` after checking its fields' types (:func:`check_types`); a
    component's own :class:`CertKVError` comes out as itself (Hydra wraps it), any other
    construction failure as one :class:`ConfigError` sentence naming ``path``."""
    check_types(node, path)
    try:
        return instantiate(node)
    except InstantiationException as exc:
        cause = exc.__cause__
        if isinstance(cause, CertKVError):
            raise cause from None
        raise ConfigError(f"the {path} config could not be built ({type(cause or exc).__name__}: "
                          f"{cause or exc}); check its fields with `certkv run --cfg job`."
                          ) from None


@dataclass
class Experiment:
    """Everything a run builds from its config before a model is loaded or a file written."""

    variants: list[Method]
    cache: CacheSpec
    tasks: list
    model: ModelSpec


def validate(cfg: DictConfig) -> Experiment:
    """Build and check every component of ``cfg`` (types, values, a model path that exists)
    without loading the model: a bad config fails here with one sentence, before any run
    directory exists."""
    check_run_fields(cfg)
    variants = build_variants(cfg)
    cache = build(cfg.cache, "cache")
    for name, node in cfg.task.items():
        require("_target_" in node, ConfigError,
                f"task.{name} has settings but no task (an experiment sets them, and the task "
                f"list leaves {name} out); keep {name} in task=[...], or leave it out with "
                f"~task.{name} instead of task=[...].")
    tasks = [build(node, f"task.{name}") for name, node in cfg.task.items()]
    build(cfg.logger, "logger")  # a bad logger must not wait for the end of the run
    model = build(cfg.model, "model")
    check_source(model)
    return Experiment(variants, cache, tasks, model)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# the run's own fields (conf/config.yaml): (accepts, what it must be, an example)
RUN_FIELDS = {
    "threads": (lambda x: x is None or (_whole(x) and x > 0),
                "a positive number of CPU threads, or null for torch's default", "threads=2"),
    "seed": (_whole, "an integer", "seed=0"),
    "graphs": (lambda x: isinstance(x, bool), "true or false", "graphs=true"),
    "audit": (lambda x: isinstance(x, bool), "true or false", "audit=true"),
}


def check_run_fields(cfg: DictConfig) -> None:
    """The run's own fields (``threads``, ``seed``, ``graphs``, ``audit``) hold what they
    must (``threads=two`` or ``threads=0`` is one sentence, not a traceback or a silent
    default)."""
    for name, (accepts, what, example) in RUN_FIELDS.items():
        value = cfg.get(name)
        require(accepts(value), ConfigError, f"{name}={value!r} must be {what}; e.g. {example}.")


def build_variants(cfg: DictConfig) -> list[Method]:
    """Instantiate ``cfg.variants``: each entry overrides fields of the component groups."""
    variants, names = [], set()
    backend = build(cfg.backend, "backend")
    for entry in cfg.variants:
        name, mode = entry.get("name"), entry.get("mode", "certified")
        require(name is not None and name not in names, ConfigError,
                f"every variant needs a unique name (got {name!r}); fix the variants list.")
        require(mode in EVAL_MODES, ConfigError,
                f"variant {name!r} has mode={mode!r}; use one of {list(EVAL_MODES)}.")
        unknown = set(entry) - {"name", "mode", "hf_cache", "press", *COMPONENTS}
        require(not unknown, ConfigError,
                f"variant {name!r} has unknown keys {sorted(unknown)}; it may set name, mode, "
                f"hf_cache (mode={HF_MODE}), press (mode={PRESS_MODE}) and "
                f"{', '.join(COMPONENTS)}.")
        parts = {c: build(_override(cfg[c], entry.get(c, {})), c) for c in COMPONENTS}
        attention = CertifiedAttention(parts["selector"], parts["value_policy"], parts["ladder"],
                                       backend, attention_mode(mode), compile=cfg.get("compile"),
                                       audit=bool(cfg.get("audit", False)))
        if cfg.get("graphs", False) and mode not in FOREIGN_MODES:  # another tool's code
            attention = GraphedAttention(attention)
        hf_cache = _hf_cache(entry) if mode == HF_MODE else None
        press = _press(entry) if mode == PRESS_MODE else None
        variants.append(Method(name, mode, attention, parts["quantizer"], parts["protect"],
                               parts["evict"], hf_cache, press))
        names.add(name)
    return variants


# classes that moved since runs were recorded: the old ``_target_`` of a run's config.yaml names
# the same class, so resuming such a run compares them as equal (a rename changes no record)
MOVED = {"certkv.cache.hf.CacheSpec": "certkv.models.hf_cache.CacheSpec"}


def _current_targets(node):
    """``node`` with every ``_target_`` that :data:`MOVED` knows renamed to its current path."""
    if isinstance(node, dict):
        return {k: MOVED.get(v, v) if k == "_target_" else _current_targets(v)
                for k, v in node.items()}
    if isinstance(node, list):
        return [_current_targets(v) for v in node]
    return node


def _hf_cache(entry) -> HFQuantized:
    """A ``mode: hf_quantized`` variant's transformers cache settings."""
    return HFQuantized.from_config(_container(entry.get("hf_cache")))


def _press(entry) -> KVPress:
    """A ``mode: kvpress`` variant's press."""
    return KVPress.from_config(_container(entry.get("press")))


def _container(node):
    """A config node as plain Python (None stays None)."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def prompt_window(variants) -> int:
    """The most prompt queries any variant's eviction policy ranks by (SnapKV), 0 if none."""
    return max((v.evict.prompt_window for v in variants if v.evict is not None), default=0)


def _override(base, change):
    """``base`` with a variant's changes merged in; a node that names another ``_target_``
    replaces the base node instead (its fields belong to another class)."""
    base = OmegaConf.to_container(base, resolve=True) if OmegaConf.is_config(base) else base
    change = (OmegaConf.to_container(change, resolve=True) if OmegaConf.is_config(change)
              else change)
    if not (isinstance(base, dict) and isinstance(change, dict)):
        return change
    if "_target_" in change and change["_target_"] != base.get("_target_"):
        return change
    merged = dict(base)
    for key, value in change.items():
        merged[key] = _override(base[key], value) if key in base else value
    return merged


def record_settings(cfg: DictConfig) -> dict[str, object]:
    """What fixes the meaning of a run's records, as plain values: the model, seed, backend and
    cache; per task its settings but the sample counts (``task:<name>``); per variant its mode
    and the components it resolves to (``variant:<name>``)."""
    def plain(node):
        return _current_targets(_container(node))

    out = {name: plain(cfg.get(name)) for name in ("model", "seed", "backend", "cache")}
    for name, node in cfg.task.items():
        out[f"task:{name}"] = {k: v for k, v in plain(node).items()
                               if k not in COUNT_FIELDS + SPEED_FIELDS}
    for entry in cfg.variants:
        mode = entry.get("mode", "certified")
        if mode == HF_MODE:  # transformers' cache: its own settings, no component of certkv
            out[f"variant:{entry.name}"] = {"mode": mode, "hf_cache": asdict(_hf_cache(entry))}
            continue
        if mode == PRESS_MODE:  # kvpress's press: its own settings
            out[f"variant:{entry.name}"] = {"mode": mode, "press": asdict(_press(entry))}
            continue
        out[f"variant:{entry.name}"] = {"mode": mode} if mode == "dense" else {"mode": mode, **{
            c: _current_targets(_override(cfg[c], entry.get(c, {}))) for c in COMPONENTS
            if c in cfg}}  # dense reads none; runs made before a group existed lack it
    return out


def _difference(old, new, path: str) -> str | None:
    """The first value that differs, as ``path: old -> new``. A key only the new settings have
    (a field added to a component since the records were made) differs where it is set away
    from the field's default, the behaviour the records were made with (:func:`_added`); a key
    only the old ones have (a field since removed) does not."""
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(new, key=str):
            at = f"{path}.{key}" if path else str(key)
            found = (_difference(old[key], new[key], at) if key in old
                     else _added(new, key, at))
            if found:
                return found
        return None
    return None if old == new else f"{path}: {old!r} -> {new!r}"


def _added(node: dict, key: str, path: str) -> str | None:
    """``path: (not set: default) -> value`` where ``node``'s field ``key``, which the records
    predate, holds another value than the default of ``node``'s ``_target_`` dataclass; None
    where it holds the default, or where the default is not a plain value this can know."""
    try:
        cls = get_class(node.get("_target_") or "")
    except Exception:  # no target, or one that no longer imports: nothing to compare with
        return None
    field = next((f for f in fields(cls) if f.name == key), None) if is_dataclass(cls) else None
    default = None if field is None else field.default
    if field is None or not isinstance(default, bool | int | float | str | type(None)) \
            or node[key] == default:
        return None
    return f"{path}: (not set: {default!r}) -> {node[key]!r}"


def check_resume(out_dir: str, cfg: DictConfig) -> None:
    """Refuse (one sentence) to resume ``out_dir`` where its records were made with other
    settings than ``cfg`` gives the same task or variant: adding variants, tasks or samples
    resumes, changing what an existing record means does not (results never mix)."""
    root = Path(out_dir)
    config, samples = root / RunDir.CONFIG, root / RunDir.SAMPLES
    records = read_jsonl(samples) if samples.exists() else []
    if not records or not config.exists():
        return
    old, new = record_settings(OmegaConf.create(config.read_text())), record_settings(cfg)
    keys = ["model", "seed", "backend", "cache"]
    keys += sorted({f"task:{r['task']}" for r in records} | {f"variant:{r['variant']}"
                                                             for r in records})
    for key in keys:
        if key not in old or key not in new:
            continue  # a task or variant no longer planned: its records stay as they are
        kind, _, name = key.partition(":")
        diff = _difference(old[key], new[key], "" if name else kind)
        label = f"{kind} {name}: " if name else ""
        require(diff is None, ConfigError,
                f"{root} holds records made with other settings ({label}{diff}); pass another "
                "run directory (hydra.run.dir=...) or restore the settings the run was made "
                "with.")


def run_experiment(cfg: DictConfig, out_dir: str, progress: bool = True,
                   command: str | None = None, invoked_by: str | None = None) -> dict:
    """Run every task sample x variant not yet recorded in ``out_dir``; returns the summary.

    ``command``: what run.json records as the command that reruns (resumes) this run (default:
    this process's arguments); ``invoked_by``: the command that launched it, when another (a
    sweep)."""
    started = time.time()
    if cfg.get("threads"):
        torch.set_num_threads(int(cfg.threads))
    torch.manual_seed(cfg.seed)
    built = validate(cfg)  # everything is checked before the run directory exists
    with exclusive_dir(out_dir, "pass another run directory (hydra.run.dir=...)"):
        check_resume(out_dir, cfg)
        return _run_validated(cfg, built, out_dir, progress, started,
                              {"experiment": cfg.experiment, "model": cfg.model.name,
                               "command": command or shlex.join(sys.argv), "seed": cfg.seed,
                               **({"invoked_by": invoked_by} if invoked_by else {})})


def _run_validated(cfg: DictConfig, built: Experiment, out_dir: str, progress: bool, started: float,
                   meta: dict) -> dict:
    """:func:`run_experiment` once ``cfg`` is validated (``built``) and ``out_dir`` is this
    process's; ``meta``: run.json's command and identity."""
    from certkv.eval.summary import summarize

    variants, spec, tasks = built.variants, built.cache, built.tasks
    lm = load_model(built.model)
    for variant in variants:  # before anything is recorded: a sweep point fails whole
        variant.quantizer.validate(lm.head_dim)
    plan = [(task, s) for task in tasks for s in task.samples(lm.tokenizer, lm.max_context)]
    shortest = min((len(s.prefix) for _, s in plan), default=0)
    for variant in variants:
        check_budget(variant.name, variant.quantizer, lm.num_kv_heads, lm.head_dim, shortest)
    for task in tasks:  # a batch too large for memory: refused before anything is written
        lengths = [len(s.prefix) for t, s in plan if t is task]
        if min(task.batch_size, len(lengths)) > 1:
            check_batch_memory(task.name, task.batch_size, lm, max(lengths))
    run = RunDir(out_dir)
    run.write_config(OmegaConf.to_yaml(cfg, resolve=True))
    planned = len(plan) * len(variants)
    run.write_meta({**meta, "planned": planned})
    run.start_session(environment())
    earlier = run.read_meta().get("wall_s", 0.0)  # wall time of earlier (resumed) sessions
    done = sum(run.done(t.name, s.index, v.name) for t, s in plan for v in variants)
    if done:
        from rich.console import Console

        Console(stderr=True).print(f"resuming {out_dir}: {done} of {planned} records done",
                                   highlight=False, soft_wrap=True)

    def progress_meta() -> None:  # after every record: an interrupted session still counts
        run.write_meta({"wall_s": earlier + time.time() - started, "records": len(run.samples)})
    exchange = _exchange(out_dir, variants, lm, cfg, meta["command"])
    if progress and any(v.mode != "dense" for v in variants) and lm.device.type == "cpu":
        announce_compile()
    with RunProgress(planned, enabled=progress) as shown:
        for task in tasks:
            samples = [s for t, s in plan if t is task]
            size = task.batch_size
            for start in range(0, len(samples), size):
                group = Group(task, samples[start : start + size], size)
                _run_group(run, group, variants, Prefills(lm, spec, exchange), shown,
                           progress_meta)
    summary = summarize(run.samples, run.certificates, tasks, variants, cfg)
    run.write_summary(summary)
    progress_meta()
    waiting = exchange and exchange.message(out_dir, meta["command"])
    if waiting:
        from rich.console import Console

        Console(stderr=True).print(waiting, highlight=False, soft_wrap=True)
    return summary


def _exchange(out_dir: str, variants: list[Method], lm, cfg: DictConfig,
              command: str) -> Exchange | None:
    """The files kvpress's process answers through, with the job it loads (the model, its
    end-of-sequence ids, the threads and the ``command`` that scores its answers), where a
    variant is ``mode: kvpress``."""
    if not any(v.mode == PRESS_MODE for v in variants):
        return None
    exchange = Exchange(out_dir)
    exchange.write_job({
        "model": {k: v for k, v in _container(cfg.model).items() if k != "_target_"},
        "stop_ids": sorted(end_of_sequence_ids(lm)), "threads": cfg.get("threads"),
        "command": command})
    return exchange


@dataclass
class Group:
    """Samples of one task whose requests decode together, ``size`` sequences at a time."""

    task: object
    samples: list
    size: int


@dataclass
class Prefills:
    """What every group's prefills need: the model and the cache settings."""

    lm: object
    spec: CacheSpec
    exchange: Exchange | None = None  # where kvpress variants are asked and answered


def _run_group(run: RunDir, group: Group, variants: list[Method], prefills: Prefills, shown,
               on_record) -> None:
    """Record every variant's results on ``group``'s samples not yet recorded: each sample
    prefilled once (dense, shared by the variants), each variant's requests decoded in
    batches (:func:`~certkv.eval.batch.answer_all`)."""
    task = group.task
    todo = {v.name: [s for s in group.samples if not run.done(task.name, s.index, v.name)]
            for v in variants}
    shown.skip(sum(len(group.samples) - len(t) for t in todo.values()))
    needed = {s.index for v in variants if v.mode != PRESS_MODE for s in todo[v.name]}
    lm = prefills.lm
    shared = {s.index: Prefill(lm, s.prefix, prompt_window(variants))
              for s in group.samples if s.index in needed}
    for variant in variants:
        samples = todo[variant.name]
        if not samples:
            continue
        if variant.mode == PRESS_MODE:  # answered by kvpress's own process
            _take_answers(run, group, variant, prefills, (shown, on_record))
            continue
        numbers = f"#{samples[0].index}" + (f"-{samples[-1].index}" if len(samples) > 1 else "")
        shown.start(f"{task.name} {numbers} {variant.name}")
        sessions = [shared[s.index].session(variant, prefills.spec) for s in samples]
        asked = [task.requests(session, s) for session, s in zip(sessions, samples, strict=True)]
        for session in sessions:
            session.on_step = shown.step
        answers = iter(answer_all([r for rs in asked for r in rs], group.size))
        for session, sample, requests in zip(sessions, samples, asked, strict=True):
            mine = [next(answers) for _ in requests]
            metrics = task.score(sample, mine, lm.tokenizer)
            size = max((a.batch for a in mine), default=1)  # sequences it was decoded with
            _record(run, task, sample, variant, session, metrics, size, prefills.spec)
            on_record()
            shown.finish()


def _take_answers(run: RunDir, group: Group, variant: Method, prefills: Prefills,
                  progress: tuple) -> None:
    """Record the kvpress answers of ``group``'s samples that kvpress's process gave (scored
    by the task's own scorer), and ask it for the others."""
    task, exchange = group.task, prefills.exchange
    shown, on_record = progress
    for sample in group.samples:
        if run.done(task.name, sample.index, variant.name):
            continue
        found = exchange.answered(task.name, sample, variant.name)
        if found is None:
            exchange.ask(task.name, sample, variant.name, variant.press,
                         task.requests(None, sample))
            shown.skip(1)
            continue
        answered = Answered(found)
        metrics = {**task.score(sample, answered.answers, prefills.lm.tokenizer),
                   **answered.provenance()}
        _record(run, task, sample, variant, answered, metrics, 1, prefills.spec)
        on_record()
        shown.finish()


def _record(run: RunDir, task, sample, variant: Method, session, metrics: dict,
            size: int, spec: CacheSpec) -> None:
    """Write one sample's record, its certificate record and (``records=full``) its heads."""
    key = {"task": task.name, "sample": sample.index, "variant": variant.name}
    ms = session.step_ms
    record = {**key, "mode": variant.mode, **metrics, **sample.meta, "decode_steps": len(ms),
              "ms_per_step": statistics.median(ms) if ms else 0.0, "batch_size": size}
    heads = None
    if spec.records == "full":
        heads = [{**key, **h} for t in session.telemetry() for h in t.log.heads]
    run.add(record, {**key, **session.certificate_record()}, heads)
