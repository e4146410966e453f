"""``certkv bench decode --batch 1 --batch 8``: whole-model decode throughput for batches of
sequences of different lengths, dense vs naive vs certified in one process, one step of each
in turn, with the certified cache's memory per sequence.

Each batch holds ``B`` book prompts from ``N`` tokens down to ``3N/4``, each prefilled alone
and joined for the decode steps as the evaluation runner joins them
(:class:`~certkv.eval.batch.BatchDecoder`); a step decodes one token of every sequence. Dense
is the model's own cache left-padded and SDPA (what a user runs instead); naive and certified
keep one store per sequence (:class:`~certkv.models.hf_cache.TieredCache`), padding in none.
"""

from __future__ import annotations

import torch

from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.bench.measure import (
    Update,
    _quiet,
    interleaved_timings,
    short,
    spread_warnings,
    stats,
    tokens,
)
from certkv.bench.tables import result_table

MODES = ("dense", "naive", "certified")
MB = 1e6


def batch_prompts(ids: list[int], context: int, batch: int) -> list[list[int]]:
    """``batch`` prompts from ``ids``: lengths from ``context`` down to ``3 context / 4``, each
    starting at its own offset of the text."""
    lengths = [context - (b * (context // 4)) // max(batch - 1, 1) for b in range(batch)]
    return [ids[b * 97 : b * 97 + n] for b, n in enumerate(lengths)]


class BatchRun:
    """One method's decoding of a batch of prompts, as the evaluation runner decodes them
    (:mod:`certkv.eval.batch`): each prompt prefilled alone, then one greedy token of every
    sequence per :meth:`step`, the caches joined (one store per sequence; dense: the model's
    own cache left-padded); with ``graphs``, naive's and certified's whole batch steps in CUDA
    graphs (:class:`~certkv.graphs.GraphedDecode`)."""

    def __init__(self, lm, prompts: list[list[int]], mode: str, quantizer=None,
                 graphs: bool = False) -> None:
        from certkv.eval.batch import BatchDecoder
        from certkv.eval.decode import Method, Prefill

        method = Method.build(mode, mode, quantizer=None if mode == "dense" else quantizer,
                              graphs=graphs and mode != "dense")
        self.quantizer = method.quantizer.label  # naive's and certified's codecs
        self.decoders = [Prefill(lm, p[:-1]).session(method).decoder() for p in prompts]
        self.batch = BatchDecoder(self.decoders)
        self.tokens = [p[-1] for p in prompts]

    def step(self) -> None:
        self.tokens = self.batch.step(self.tokens).argmax(dim=-1).tolist()

    def cache_bytes(self) -> dict[str, int]:
        """The byte accounting of every sequence's cache, summed."""
        held = [d.cache.bytes() for d in self.decoders]
        return {name: sum(h[name] for h in held) for name in held[0]}


def bench_batches(model: str, contexts: list[int], batches: list[int], device: torch.device,
                  repeats: int, dtype: torch.dtype, *, update: Update = _quiet,
                  weights: str = "auto", quantizer=None, graphs: bool = False) -> list[dict]:
    """Per context and batch size: each method's step time (min / median / max of ``repeats``
    after warm-up, the methods' steps interleaved), tokens per second over the batch, and the
    certified cache's bytes per sequence; ``quantizer`` (a :class:`~certkv.quant.KVQuantizer`,
    default the paper's INT8/INT4) is naive's and certified's, ``graphs`` replays their whole
    steps as CUDA graphs (:class:`BatchRun`)."""
    update(f"{model}: building the model ({weights} weights)")
    lm, used = _decode_model(model, weights, device, dtype)
    records = []
    for context in contexts:
        text = _decode_prompt(lm, context + 97 * max(batches))
        for batch in batches:
            label = f"N={tokens(context)} B={batch}"
            update(f"{label}: prefill of every method")
            decoders = {mode: BatchRun(lm, batch_prompts(text, context, batch), mode, quantizer,
                                       graphs) for mode in MODES}
            update(f"{label}: decode steps in turn")
            timed = interleaved_timings({m: d.step for m, d in decoders.items()}, repeats)
            row = {"model": model, "weights": used, "context": context, "batch": batch,
                   "quantizer": decoders["certified"].quantizer, "graphs": graphs,
                   "ms_stats": {m: stats(t) for m, t in timed.items()}}
            row["ms"] = {m: s["median"] for m, s in row["ms_stats"].items()}
            row["tokens_per_s"] = {m: 1e3 * batch / ms for m, ms in row["ms"].items()}
            held = decoders["certified"].cache_bytes()
            row["bytes_per_sequence"] = {name: held[name] / batch for name in held}
            records.append(row)
            update(label, advance=1)
    return _speedups(records)


def _speedups(records: list[dict]) -> list[dict]:
    """Each row's throughput against its context's batch of one, and certified / dense."""
    ones = {r["context"]: r for r in records if r["batch"] == 1}
    for r in records:
        r["certified_over_dense"] = r["ms"]["certified"] / r["ms"]["dense"]
        one = ones.get(r["context"])
        r["speedup"] = None if one is None else {
            m: r["tokens_per_s"][m] / one["tokens_per_s"][m] for m in MODES}
    return records


def batch_notes(records: list[dict]) -> list[str]:
    """The report's notes: a warning for each context and batch whose timings spread."""
    return spread_warnings([{"short_label": f"N={r['context']} B={r['batch']}",
                             "ms_stats": r["ms_stats"]} for r in records])


def batch_tables(records: list[dict]):
    """Tokens per second per context, batch size and method, and memory per sequence."""
    model = records[0]["model"] if records else ""
    named = [records[0]["quantizer"]] if records and "quantizer" in records[0] else []
    named += ["CUDA graphs"] if records and records[0].get("graphs") else []
    codecs = f" ({', '.join(named)})" if named else ""
    speed = result_table(
        f"{model}{codecs}: decode throughput, tokens/s over the batch (median step)",
        [("N", "context tokens of the longest sequence (the shortest: 3N/4)"),
         ("B", "sequences in the batch"), *((m, f"{m} tokens/s") for m in MODES),
         ("c/d", "certified step / dense step"),
         ("xB1", "certified tokens/s against the same context's batch of one")], keys=2)
    memory = result_table(
        f"{model}{codecs}: certified cache per sequence, MB over every layer",
        [("N", "context tokens"), ("B", "sequences"), ("T1", "Tier-1 (codes and metadata)"),
         ("ann", "annotations"), ("T2", "Tier-2 FP16 originals (host)"),
         ("mir", "decoded mirror (CPU workspace)"),
         ("scr", "scratch FP16 blocks held (a CPU store: what a device scratch would hold)"),
         ("fp16", "a dense FP16 cache")], keys=2)
    for r in records:
        up = r["speedup"]["certified"] if r["speedup"] else None
        speed.rows.append([tokens(r["context"]), str(r["batch"]),
                           *(short(r["tokens_per_s"][m]) for m in MODES),
                           f"{r['certified_over_dense']:.2f}x",
                           "n/a" if up is None else f"{up:.2f}x"])
        per = r["bytes_per_sequence"]
        memory.rows.append([tokens(r["context"]), str(r["batch"]),
                            *(short(per.get(k, 0) / MB) for k in (
                                "tier1", "annotation", "tier2", "workspace", "scratch",
                                "dense"))])
    return [speed, memory]


def plot_batches(records: list[dict], path) -> None:
    """Tokens per second against batch size, one line per method and context."""
    from certkv.bench.measure import METHOD_COLORS
    from certkv.bench.plots import SHAPE_STYLES, _figure

    plt, fig, ax = _figure((6.4, 4.0))
    contexts = sorted({r["context"] for r in records})
    for i, context in enumerate(contexts):
        rows = sorted((r for r in records if r["context"] == context), key=lambda r: r["batch"])
        line, marker = SHAPE_STYLES[i % len(SHAPE_STYLES)]
        for mode in MODES:
            ax.plot([r["batch"] for r in rows], [r["tokens_per_s"][mode] for r in rows],
                    line, marker=marker, color=METHOD_COLORS[mode],
                    label=f"{mode}, N={tokens(context)}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("sequences in the batch")
    ax.set_ylabel("tokens / s")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
