"""``certkv bench codecs``: what each quantizer costs in memory and dequantization time.

Seed 004's targets, measured: archive compression (bytes per token against FP16, metadata
counted) and dequantization time per 1K tokens per layer. Two views, on one layer's synthetic
keys and values (Gaussian with outlier channels; SmolLM2-135M's shape by default, 3 kv heads,
d = 64):

* per precision: each distinct precision of the quantizer configs (``conf/quantizer/``) encodes
  the whole context; bytes per token per kv head of its codes and metadata, and the median time
  to decode every block's keys and values (the PyTorch reference decode, on ``device``) per 1K
  tokens;
* per quantizer: a :class:`~certkv.cache.store.TieredKVStore` of the whole context (blocks at
  their ages' precisions: exact windows, warm, archive); Tier-1 bytes per token per kv head and
  the device total (Tier-1, the six FP32 block annotations, the FP16 tail).

FP16 holds ``4 d`` bytes per token per kv head (keys and values).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from hydra.utils import instantiate

from certkv.bench import Update, result_table, short, spread_warnings, stats, timings, tokens
from certkv.cache.store import TieredKVStore
from certkv.config import config_groups, option
from certkv.quant import Precision
from certkv.quant.rope import RopeSpec
from certkv.report.layout import Table

# (label, conf/quantizer name, option changes): the quantizers of the methods experiments, in
# the order of the committed report; every other conf/quantizer YAML follows as it is
# (:func:`quantizers`), so a quantizer added as one file + one YAML is benchmarked too
METHODS = (("int8_int4", "int8_int4", ()), ("kivi4", "kivi4", ()), ("kivi2", "kivi2", ()),
           ("tiers-kivi2", "tiers", ("archive=kivi2",)),
           ("tiers-rotation", "tiers", ("archive=rotation",)),
           ("tiers-kvquant", "tiers", ("archive=kvquant",)),
           ("kivi2-sink", "kivi2", ("sink=32", "residual=96")), ("innerq", "innerq", ()),
           ("smartkv-b25", "smartkv", ("beta=0.25",)), ("smartkv-b40", "smartkv", ("beta=0.4",)))


def quantizers(only: list[str] | None = None) -> list[tuple[str, str, tuple[str, ...]]]:
    """:data:`METHODS`, then every ``conf/quantizer`` option they leave out, as configured;
    ``only``: the points of these options alone."""
    named = {name for _, name, _ in METHODS}
    points = [*METHODS, *((name, name, ()) for name in config_groups()["quantizer"]
                          if name not in named)]
    return [p for p in points if not only or p[1] in only]


@dataclass
class CodecCase:
    """One layer's cache: ``context`` tokens, ``kv_heads`` x ``head_dim``; RoPE base for
    pre-RoPE keys (SmolLM2: 100000)."""

    context: int = 4096
    kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    seed: int = 0

    def kv(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 keys and values ``[Hkv, context, d]``: unit Gaussians, keys with two outlier
        channels (x10) and an offset, as real keys have."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (self.kv_heads, self.context, self.head_dim)
        k = torch.randn(shape, generator=gen) + 0.5
        k[..., :2] *= 10.0
        v = torch.randn(shape, generator=gen)
        return k.half().to(device), v.half().to(device)


def quantizer(name: str, changes: tuple[str, ...], case: CodecCase):
    """The quantizer of ``conf/quantizer/<name>.yaml`` with ``changes``, RoPE bound."""
    built = instantiate(option("quantizer", name, *changes))
    return built.with_rope(RopeSpec.from_theta(case.rope_theta, case.head_dim))


def precision_record(precision: Precision, block: int, case: CodecCase, k: torch.Tensor,
                     v: torch.Tensor, repeats: int) -> dict:
    """Bytes per token per kv head and decode ms per 1K tokens of one precision encoding the
    whole context (``k, v [Hkv, N, d]``, whole blocks of ``block`` tokens)."""
    n = case.context // block
    kb = k[:, : n * block].reshape(case.kv_heads, n, block, case.head_dim)
    vb = v[:, : n * block].reshape(case.kv_heads, n, block, case.head_dim)
    starts = torch.arange(n, device=k.device) * block
    keys = precision.key_codec.encode_at(kb, starts)
    values = precision.value_codec.encode(vb)
    nbytes = sum(t.numel() * t.element_size() for t in (*keys.values(), *values.values()))
    per_token = nbytes / (case.kv_heads * n * block)

    def decode() -> None:
        precision.key_codec.decode(keys)
        precision.value_codec.decode(values)

    ms = stats(timings(decode, repeats, warmup=1))
    return {"precision": precision.name, "codes": codes(precision), "block": block,
            "bytes_per_token": per_token, "compression": 4 * case.head_dim / per_token,
            "dequant_ms_per_1k": ms["median"] * 1000 / (n * block), "ms_stats": ms}


def store_record(label: str, q, case: CodecCase, k: torch.Tensor, v: torch.Tensor) -> dict:
    """A store of the whole context under quantizer ``q``: Tier-1 and device bytes per token
    per kv head, and Tier-1 bytes by precision."""
    store = TieredKVStore(case.kv_heads, case.head_dim, device=k.device, **q.store_kwargs())
    store.append(k, v)
    completed = case.kv_heads * store.num_blocks * store.block_size
    per_token = store.tier1_bytes() / completed
    device = store.device_bytes() / (case.kv_heads * store.num_tokens)
    return {"quantizer": label, "tokens": store.num_tokens, "tier1_per_token": per_token,
            "device_per_token": device, "compression": 4 * case.head_dim / per_token,
            "by_precision": {name: b for name, b in store.precision_bytes().items() if b}}


def codes(precision: Precision) -> str:
    """Its codecs in a few characters, e.g. ``kivi2/int4_group2``."""
    return "/".join(f"{c.name}{c.bits}" for c in (precision.key_codec, precision.value_codec))


def lossy_precisions(q) -> list[Precision]:
    """The lossy precisions ``q`` stores blocks at (a tiered quantizer: warm and its chosen
    archive)."""
    chosen = getattr(q, "archive", None)
    return [p for p in q.precisions() if not p.exact
            and (not p.name.startswith("archive-") or p.name == f"archive-{chosen}")]


def bench_codecs(case: CodecCase, device: torch.device, repeats: int,
                 update: Update, points=None) -> dict[str, list[dict]]:
    """``{"precisions": [...], "stores": [...]}`` over ``points`` (default
    :func:`quantizers`)."""
    k, v = case.kv(device)
    precisions, stores, seen = [], [], set()
    for label, name, changes in points or quantizers():
        q = quantizer(name, changes, case)
        update(f"codecs: {label}")
        for p in lossy_precisions(q):
            if codes(p) not in seen:
                seen.add(codes(p))
                precisions.append({"quantizer": label, **precision_record(
                    p, q.block_size, case, k, v, repeats)})
        stores.append(store_record(label, q, case, k, v))
        update(f"codecs: {label}", advance=1)
    return {"precisions": precisions, "stores": stores}


def codec_notes(records: dict[str, list[dict]]) -> list[str]:
    """The report's notes: a warning for each precision whose decode timings spread."""
    return spread_warnings([{"short_label": f"{r['quantizer']}:{r['precision']}",
                             "ms_stats": {"decode": r["ms_stats"]}}
                            for r in records["precisions"]])


def codec_tables(records: dict[str, list[dict]], case: CodecCase) -> list[Table]:
    fp16 = 4 * case.head_dim
    per = result_table(
        f"Per precision: bytes and dequantization ({tokens(case.context)} tokens, "
        f"{case.kv_heads} kv heads, d={case.head_dim}; FP16 = {fp16} B/token)",
        [("quantizer", "first quantizer using it"), ("precision", ""),
         ("codes", "key codec and bits / value codec and bits"),
         ("B/tok", "bytes per token per kv head, keys + values, metadata counted"),
         ("xFP16", "compression against FP16"),
         ("ms/1K", "median ms to decode keys and values of 1K tokens of one layer")], keys=2)
    for r in records["precisions"]:
        per.rows.append([r["quantizer"], r["precision"], r["codes"], short(r["bytes_per_token"]),
                         f"{r['compression']:.2f}", short(r["dequant_ms_per_1k"])])
    whole = result_table(
        f"Per quantizer: the store at {tokens(case.context)} tokens",
        [("quantizer", ""), ("T1 B/tok", "Tier-1 bytes per completed token per kv head"),
         ("xFP16", "compression of Tier-1 against FP16"),
         ("device B/tok", "Tier-1 + block annotations + FP16 tail, per token per kv head"),
         ("by precision", "Tier-1 bytes (KiB) held by each precision")])
    for r in records["stores"]:
        held = ", ".join(f"{n} {b / 1024:.0f}" for n, b in r["by_precision"].items())
        whole.rows.append([r["quantizer"], short(r["tier1_per_token"]),
                           f"{r['compression']:.2f}", short(r["device_per_token"]), held])
    return [per, whole]


def codecs_figure(records: dict[str, list[dict]]):
    """Bytes per token against dequantization time (log), one point per precision in its
    quantizer's colour and marker, each labelled beside it: labels are placed apart, with a
    leader line where one had to move away from its point
    (:func:`certkv.report.look.place_labels`)."""
    from certkv.bench.plots import _figure
    from certkv.report.look import place_labels, style

    _, fig, ax = _figure((7.2, 4.8))
    found = records["precisions"]
    quantizers = list(dict.fromkeys(r["quantizer"] for r in found))
    points = [(r["bytes_per_token"], r["dequant_ms_per_1k"]) for r in found]
    for r, (x, y) in zip(found, points, strict=True):
        look = style(quantizers.index(r["quantizer"]))
        ax.plot([x], [y], linestyle="none", marker=look["marker"], color=look["color"],
                markersize=6, gid=f"{r['quantizer']}:{r['precision']}")
    ax.set_xlabel("bytes per token per kv head (FP16: 4 d)")
    ax.set_ylabel("dequantization ms per 1K tokens per layer")
    ax.set_yscale("log")
    ax.margins(x=0.18, y=0.12)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    place_labels(ax, points, [f"{r['quantizer']}:{r['precision']}" for r in found])
    return fig


def plot_codecs(records: dict[str, list[dict]], path) -> None:
    """Write :func:`codecs_figure` to ``path``."""
    from certkv.report.look import _pyplot

    fig = codecs_figure(records)
    fig.savefig(path, dpi=120, bbox_inches="tight", pad_inches=0.1)
    _pyplot().close(fig)
