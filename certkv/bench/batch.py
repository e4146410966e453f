"""``certkv bench decode --batch 1 --batch 8``: whole-model decode throughput for batches of
sequences of different lengths, dense vs naive vs certified in one process, one step of each
in turn, with the certified cache's memory per sequence.

Each batch holds ``B`` book prompts from ``N`` tokens down to ``3N/4`` (left-padded, as a
tokenizer pads for generation); a step decodes one token of every sequence. Dense is the
model's own cache and SDPA over the padded batch (what a user runs instead); naive and certified
keep one store per sequence (:class:`~certkv.models.hf_cache.TieredCache`), padding in none.
"""

from __future__ import annotations

import torch

from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.bench.measure import Update, _quiet, interleaved_timings, short, stats, tokens
from certkv.bench.tables import result_table

MODES = ("dense", "naive", "certified")
MB = 1e6


def batch_prompts(ids: list[int], context: int, batch: int) -> list[list[int]]:
    """``batch`` prompts from ``ids``: lengths from ``context`` down to ``3 context / 4``, each
    starting at its own offset of the text."""
    lengths = [context - (b * (context // 4)) // max(batch - 1, 1) for b in range(batch)]
    return [ids[b * 97 : b * 97 + n] for b, n in enumerate(lengths)]


class BatchDecoder:
    """One method's decoding of a left-padded batch: the prefill, then one greedy token of every
    sequence per :meth:`step` (positions from the mask, so padding shifts no sequence)."""

    def __init__(self, lm, prompts: list[list[int]], mode: str) -> None:
        from transformers import DynamicCache

        from certkv.attention import CertifiedAttention
        from certkv.models import cache_kwargs
        from certkv.models.hf_cache import TieredCache

        self.lm, self.batch = lm, len(prompts)
        self.cache = DynamicCache() if mode == "dense" else TieredCache(
            lm.num_layers, CertifiedAttention(mode=mode))
        self.kwargs = cache_kwargs(lm.model, self.cache)
        longest = max(len(p) for p in prompts)
        device = lm.model.device
        ids = torch.zeros(self.batch, longest, dtype=torch.long, device=device)
        self.mask = torch.zeros_like(ids)
        for b, p in enumerate(prompts):
            ids[b, longest - len(p):] = torch.tensor(p, device=device)
            self.mask[b, longest - len(p):] = 1
        self.token = self._forward(ids)

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = (self.mask.cumsum(dim=-1) - 1).clamp(min=0)[:, -ids.shape[1]:]
        with torch.inference_mode():
            logits = self.lm.model(input_ids=ids, attention_mask=self.mask,
                                   position_ids=positions, **self.kwargs).logits
        return logits[:, -1:].argmax(dim=-1)

    def step(self) -> None:
        ones = torch.ones(self.batch, 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        self.token = self._forward(self.token)


def bench_batches(model: str, contexts: list[int], batches: list[int], device: torch.device,
                  repeats: int, dtype: torch.dtype, *, update: Update = _quiet,
                  weights: str = "auto") -> list[dict]:
    """Per context and batch size: each method's step time (min / median / max of ``repeats``
    after warm-up, the methods' steps interleaved), tokens per second over the batch, and the
    certified cache's bytes per sequence."""
    update(f"{model}: building the model ({weights} weights)")
    lm, used = _decode_model(model, weights, device, dtype)
    records = []
    for context in contexts:
        text = _decode_prompt(lm, context + 97 * max(batches))
        for batch in batches:
            label = f"N={tokens(context)} B={batch}"
            update(f"{label}: prefill of every method")
            decoders = {mode: BatchDecoder(lm, batch_prompts(text, context, batch), mode)
                        for mode in MODES}
            update(f"{label}: decode steps in turn")
            timed = interleaved_timings({m: d.step for m, d in decoders.items()}, repeats)
            row = {"model": model, "weights": used, "context": context, "batch": batch,
                   "ms_stats": {m: stats(t) for m, t in timed.items()}}
            row["ms"] = {m: s["median"] for m, s in row["ms_stats"].items()}
            row["tokens_per_s"] = {m: 1e3 * batch / ms for m, ms in row["ms"].items()}
            held = decoders["certified"].cache.bytes()
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


def batch_tables(records: list[dict]):
    """Tokens per second per context, batch size and method, and memory per sequence."""
    model = records[0]["model"] if records else ""
    speed = result_table(
        f"{model}: decode throughput, tokens/s over the batch (median step)",
        [("N", "context tokens of the longest sequence (the shortest: 3N/4)"),
         ("B", "sequences in the batch"), *((m, f"{m} tokens/s") for m in MODES),
         ("c/d", "certified step / dense step"),
         ("xB1", "certified tokens/s against the same context's batch of one")], keys=2)
    memory = result_table(
        f"{model}: certified cache per sequence, MB over every layer",
        [("N", "context tokens"), ("B", "sequences"), ("T1", "Tier-1 (codes and metadata)"),
         ("ann", "annotations"), ("T2", "Tier-2 FP16 originals (host)"),
         ("mir", "decoded mirror (CPU workspace)"), ("fp16", "a dense FP16 cache")], keys=2)
    for r in records:
        up = r["speedup"]["certified"] if r["speedup"] else None
        speed.rows.append([tokens(r["context"]), str(r["batch"]),
                           *(short(r["tokens_per_s"][m]) for m in MODES),
                           f"{r['certified_over_dense']:.2f}x",
                           "n/a" if up is None else f"{up:.2f}x"])
        per = r["bytes_per_sequence"]
        memory.rows.append([tokens(r["context"]), str(r["batch"]),
                            *(short(per[k] / MB) for k in ("tier1", "annotation", "tier2",
                                                          "workspace", "dense"))])
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
