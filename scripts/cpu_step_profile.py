"""Where one CPU layer step's time goes (issue 55): the numba backend's certified step (one
compiled call, :mod:`certkv.kernels.numba_step`) split into the kernels it calls, beside the
Python around that call, the fallback (rungs 3-4) and the dense step of the same layer, all in
one process.

The split runs the step's own body (``_step.py_func``, the same kernels on the same arrays:
the compiled call's numbers) with each kernel timed as it is called; the compiled call itself
is timed on the same arguments, and the whole step (layout, argument marshalling, certificate
objects) as users call it. Medians over ``--repeats`` calls of each, after warm-up.

    .venv/bin/python scripts/cpu_step_profile.py [--context 4096 --context 8192] [--repeats 200]
        [--model smollm2_135m --layer 15] [--out DIR]

The default layer is SmolLM2-135M's shape (3 kv heads x 3 query heads each, d = 64) with
synthetic keys (:class:`~certkv.bench.AttentionCase`); ``--model`` takes the query, keys and
values of layer ``--layer`` of that model's first decode step after a dense prefill of the
context of a book (:func:`evict_frontier.captured_decode`). Each case also says how many
blocks the step read in FP16: its heads' ``K*`` and FP16 value blocks against the quantized
blocks, the part of its bytes (and of its logits, computed twice) beyond the codes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from certkv import CertifiedAttention, TieredKVStore
from certkv.bench import AttentionCase, device_info
from certkv.bench.attention import layer_steps
from certkv.bench.measure import interleaved_timings, timing_calls, timings
from certkv.bench.tables import provenance, share_rows
from certkv.cache.scratch import ScratchCache
from certkv.certify import fused_cpu, fused_select
from certkv.files import write_atomic
from certkv.kernels import numba_attend, numba_backend, numba_logits, numba_step
from certkv.kernels.reference import dense_attention
from certkv.step import QuantizedStep

# the kernels the compiled step calls, in its order: (module, function, what it computes)
KERNELS = ((numba_backend, "_phase1", "phase 1: INT8-key logits, block states, Delta_b"),
           (fused_select, "_kernel", "selection (rung 1, value promotion)"),
           (numba_logits, "_gated_logits", "phase 2: FP16-key logits of promoted blocks"),
           (numba_attend, "attend", "phase 2: softmax, value sums, checks"),
           (fused_cpu, "_kernel", "certificate (eq. 15, Cor. 4.2, E_arith)"),
           (fused_cpu, "_rungs", "rungs"))


def step_arguments(certified) -> tuple:
    """The arguments of the compiled call in one certified step ``certified()``."""
    seen, real = [], numba_step._step

    def keep(*args):
        seen.append(args)
        return real(*args)

    numba_step._step = keep
    try:
        certified()
    finally:
        numba_step._step = real
    if not seen:
        sys.exit("this step does not run as one numba call (numba missing, or a store or "
                 "setting numba_step.covers excludes); nothing to split.")
    return seen[0]


def model_steps(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> dict:
    """The dense and certified steps (as :func:`~certkv.bench.attention.layer_steps` makes
    them) over a captured layer: ``q [Hq, d]``, FP16 ``k, v [Hkv, N, d]``."""
    certified = CertifiedAttention()
    store = TieredKVStore(k.shape[0], k.shape[2],
                          decoded_mirror=certified.decoded_mirror(torch.device("cpu")))
    store.append(k, v)
    q, scratch = q.float(), ScratchCache()
    return {"dense": lambda: dense_attention(q, k.float(), v.float(), scaling),
            "certified": lambda: certified(q, store, scaling, scratch=scratch)}


def captured_layers(model: str, layer: int, contexts: list[int]) -> dict:
    """``{context: (q, k, v, scaling)}`` of ``layer`` at ``model``'s first decode step after
    each context (its own weights, a book's text)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from evict_frontier import captured_decode

    out = {}
    for context in contexts:
        def keep(at, q, k, v, scaling, context=context):
            if at == layer and context not in out:
                out[context] = (q.clone(), k[:, :context].clone(), v[:, :context].clone(),
                                scaling)
        captured_decode(model, "auto", context, 1, keep, "certkv_cpu_step_profile")
    return out


def profile(case: AttentionCase, repeats: int, steps: dict | None = None) -> dict:
    """Medians (ms) of the dense step, the whole certified step, its compiled call and each
    kernel of that call on ``case``'s layer (or the ``steps`` of a captured one,
    :func:`model_steps`), and what the step read in FP16."""
    if steps is None:
        _, steps, _ = layer_steps(case, torch.device("cpu"), None, "auto")
    args = step_arguments(steps["certified"])
    # the step and its compiled call in turn (a slow spell of the machine falls on both, and
    # both find the same data in cache); dense in its own loop, as its FP32 cache (25 MB at
    # 16K) would evict theirs
    fallback: dict[str, list[float]] = {}
    with timing_calls([(QuantizedStep, "_fallback")], fallback):
        runs = interleaved_timings({"certified": steps["certified"],
                                    "compiled": lambda: numba_step._step(*args)}, repeats)
    med = {name: statistics.median(t) for name, t in runs.items()}
    med["dense"] = statistics.median(timings(steps["dense"], repeats))
    med["fallback"] = statistics.median(fallback["QuantizedStep._fallback"])
    times = {f"{m.__name__}.{n}": [] for m, n, _ in KERNELS}
    with timing_calls([(m, n) for m, n, _ in KERNELS], times):
        timings(lambda: numba_step._step.py_func(*args), repeats)
    calls = {name: len(t) // (repeats + 2) for name, t in times.items()}  # 2 warm-up calls
    kernels = {name: statistics.median(t) if t else 0.0 for name, t in times.items()}
    _, cert = steps["certified"]()
    quantized = max(cert.num_blocks, 1)  # the step's quantized blocks
    return {"case": case.__dict__, "label": case.label, "repeats": repeats, "ms": med,
            "kernels": kernels, "calls": calls, "dense_heads": int((cert.rung >= 3).sum()),
            "heads": int(cert.rung.numel()),
            "fp16_keys": float(cert.k_star.double().mean()) / quantized,
            "fp16_values": float(cert.value_blocks.double().mean()) / quantized}


def render(results: list[dict], info: dict, command: str) -> str:
    """The report: each context's split as a column of one markdown table, with command,
    commit and machine."""
    first = results[0]["case"]
    shape = (f"d = {first['head_dim']}, {first['kv_heads'] * first['group']} query / "
             f"{first['kv_heads']} kv heads")
    rows = [("dense step (FP32 SDPA over the layer's cache)", lambda r: r["ms"]["dense"]),
            ("**certified step, as called**", lambda r: r["ms"]["certified"]),
            ("Python around the compiled call and the fallback",
             lambda r: r["ms"]["certified"] - r["ms"]["compiled"] - r["ms"]["fallback"]),
            ("the fallback (rungs 3-4: dense heads over the FP16 originals)",
             lambda r: r["ms"]["fallback"]),
            ("the compiled call", lambda r: r["ms"]["compiled"])]
    rows += [(f"kernel: {what}", lambda r, k=f"{m.__name__}.{n}": r["kernels"][k])
             for m, n, what in KERNELS]
    source = results[0].get("data", "synthetic keys")
    lines = [f"# Where a CPU layer step's time goes ({shape}; {source})", "",
             *provenance(command, info, copy=True, threads=True), "",
             f"Medians of {results[0]['repeats']} calls each after 2 warm-up calls, one "
             "process (the certified step and its compiled call in turn, the dense step apart). %: "
             "share of the certified step. The kernels are timed one by one as the compiled "
             "call's own body calls them (each call's dispatch from Python included).", "",
             *share_rows(rows, results, [f"N={r['case']['context']}" for r in results],
                         lambda r: r["ms"]["certified"]), ""]
    for r in results:
        ms = r["ms"]
        lines.append(f"N={r['case']['context']}: certified / dense "
                     f"{ms['certified'] / ms['dense']:.2f}x; {r['dense_heads']} of "
                     f"{r['heads']} heads on rungs 3-4; the kernels one by one sum to "
                     f"{sum(r['kernels'].values()):.3f} ms, the compiled call "
                     f"{ms['compiled']:.3f} ms; FP16 keys read for {r['fp16_keys']:.0%} "
                     f"of the quantized blocks (K* over a head's quantized blocks, the mean "
                     f"head), FP16 values for {r['fp16_values']:.0%}.  ")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, action="append",
                        help="context tokens (repeat for several; default 4096)")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--group", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--model", default=None,
                        help="profile this model's own layer (its weights, a book's text), "
                             "e.g. smollm2_135m; default: synthetic keys of --head-dim etc.")
    parser.add_argument("--layer", type=int, default=15, help="with --model: which layer")
    parser.add_argument("--out", type=Path, default=None,
                        help="write cpu_step_profile.md and .json here")
    a = parser.parse_args(argv)
    contexts = a.context or [4096]
    if min(contexts) < 1 or a.repeats < 1:
        parser.error("--context and --repeats take positive numbers, e.g. --context 4096")
    if a.model:
        layers = captured_layers(a.model, a.layer, contexts)
        results = []
        for n in contexts:
            q, k, v, scaling = layers[n]
            case = AttentionCase(n, k.shape[2], k.shape[0], q.shape[0] // k.shape[0])
            result = profile(case, a.repeats, model_steps(q, k, v, scaling))
            results.append({**result, "data": f"{a.model} layer {a.layer}"})
    else:
        results = [profile(AttentionCase(n, a.head_dim, a.kv_heads, a.group), a.repeats)
                   for n in contexts]
    info = device_info()
    command = ("python scripts/cpu_step_profile.py " + " ".join(
        sys.argv[1:] if argv is None else argv)).strip()
    text = render(results, info, command)
    print(text)
    if a.out:
        write_atomic(a.out / "cpu_step_profile.md", text)
        write_atomic(a.out / "cpu_step_profile.json",
                     json.dumps({"command": command, **info, "results": results}, indent=2)
                     + "\n")


if __name__ == "__main__":
    main()
