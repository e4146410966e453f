"""Where certified eviction's frontier lies (issue 56): how many FP16 value blocks a
certificate must read to bound a head's value error by ``tol``, even if it knew every logit
exactly.

A kept block holds INT4 values (the paper's codec), an evicted one a centre and a radius (the
summaries' value codec, :class:`~certkv.quant.summary.SummaryValueCodec`), so the certificate's
value term over the blocks whose values it does not read is at least ``sum_b min(rho_b eta_b,
s_b ||p_b||_2)`` (Cor. 4.2 as certkv sharpens it: ``rho_b`` the block's attention mass, ``p_b``
its tokens' probabilities, ``eta_b`` the codec's largest per-token error, ``s_b`` the spectral
norm of the block's value errors). Here the masses and probabilities are the exact FP64 ones,
which no summary of the keys gives: a certificate built on any key summary sees them only
through upper bounds, so it must read at least as much. The fewest blocks whose reading brings
that sum to ``tol`` are the largest terms (:func:`~certkv.certify.values.fewest_covering`); a
kv head reads the union of its query heads' sets.

Run on real SmolLM2 decode steps: a dense prefill of ``N`` tokens of the default book, then
teacher-forced decode steps, every layer's query, keys and values taken from the model's own
attention call (FP16-rounded keys and values, as Tier-2 holds them). The evicted blocks are
none (``none``), those the streaming policy evicts at each Tier-1 budget (a
:class:`TieredKVStore` per layer fed the same keys and values, INT8 keys and INT4 values, box
summaries), and those an idealised policy would, which keeps, at the same count, the blocks
with the most attention at that very step (``topmass``: no policy can fit a step better).

    .venv/bin/python scripts/evict_frontier.py [--context 4096] [--steps 8] [--budget 0.25]
        [--weights auto|real|random] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from certkv.bench import device_info
from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.bench.tables import provenance
from certkv.cache.annotations import block_annotations
from certkv.cache.store import TieredKVStore
from certkv.certify.bounds import block_deltas, tightened_deltas
from certkv.certify.targeted import key_shares
from certkv.certify.values import fewest_covering
from certkv.errors import BudgetError
from certkv.evict import StreamingEviction
from certkv.files import write_atomic
from certkv.quant import KVQuantizer
from certkv.registry import SUMMARIES

TOLS = (0.01, 0.05, 0.1, 0.5)
POLICIES = ("streaming", "topmass")
KEY_SUMMARIES = ("box", "keys2")


def block_probabilities(q: torch.Tensor, k: torch.Tensor, scaling: float, block: int
                        ) -> torch.Tensor:
    """FP64 attention probabilities of the completed blocks' tokens ``[Hq, n, B]`` for queries
    ``q [Hq, d]`` over keys ``k [Hkv, T, d]`` (GQA: head ``h`` reads kv head ``h // G``)."""
    hkv, tokens, _ = k.shape
    group = q.shape[0] // hkv
    logits = torch.einsum("hgd,htd->hgt", q.double().view(hkv, group, -1), k.double()) * scaling
    p = torch.softmax(logits, dim=-1).reshape(q.shape[0], tokens)
    n = tokens // block
    return p[:, : n * block].reshape(q.shape[0], n, block)


def block_notes(k: torch.Tensor, v: torch.Tensor, block: int, precision
                ) -> tuple[dict, torch.Tensor]:
    """The completed blocks of FP16 keys and values ``k, v [Hkv, T, d]`` held at ``precision``:
    the store's own write-time annotations ``[Hkv, n]`` (:func:`~certkv.cache.annotations.
    block_annotations`: ``eta``, ``value_spec``, ``key_err`` with the codec's decode slack,
    ``nu``, ``v_radius``) and the key codec's channel bound ``[Hkv, n, d]``. The centre of the
    radius is the values' per-channel midrange (the store fixes its own from the prompt's)."""
    hkv, tokens, d = k.shape
    n = tokens // block
    kb, vb = (x[:, : n * block].reshape(hkv, n, block, d) for x in (k, v))
    key_codec, value_codec = precision.key_codec, precision.value_codec
    key_codec.validate(d, block)
    value_codec.validate(d, block)
    keys, values = key_codec.encode(kb), value_codec.encode(vb)
    x = v.float()
    centre = (x.amax(dim=1) + x.amin(dim=1)) / 2
    notes = block_annotations(kb, vb, key_codec, value_codec, keys, values, centre)
    return notes, key_codec.channel_bound(keys)


def value_terms(p: torch.Tensor, eta: torch.Tensor, spectral: torch.Tensor, group: int
                ) -> torch.Tensor:
    """``min(rho_b eta_b, s_b ||p_b||_2)`` ``[Hq, n]`` per query head and block (Cor. 4.2)."""
    rho, norm = p.sum(dim=-1), p.norm(dim=-1)
    per_head = torch.repeat_interleave
    return torch.minimum(rho * per_head(eta, group, 0), norm * per_head(spectral, group, 0))


def key_deltas(q: torch.Tensor, scaling: float, notes: dict, channel_bound: torch.Tensor
               ) -> torch.Tensor:
    """``Delta_b [Hq, n]``: the largest logit error of each completed block's keys, as the step
    bounds it from their annotations (:func:`block_notes`): eq. 8's channel form, tightened by
    ``scaling ||q||`` times the block's largest per-token key error
    (:func:`~certkv.certify.bounds.tightened_deltas`)."""
    hkv, n = notes["key_err"].shape
    qg = q.double().view(hkv, -1, q.shape[-1])
    channel = block_deltas(qg, channel_bound.double(), scaling).double()
    return tightened_deltas(channel, qg.norm(dim=-1), notes["key_err"].double(),
                            scaling).reshape(q.shape[0], n)


def key_terms(p: torch.Tensor, delta: torch.Tensor, radius: torch.Tensor) -> torch.Tensor:
    """Each block's share of E_key ``[Hq, n]`` were its keys read lossily, on the exact masses
    (:func:`~certkv.certify.targeted.key_shares`, the shares ``ladder.tol_page_in`` ranks
    blocks by; every block's keys lossy)."""
    return key_shares(p.sum(dim=-1), delta, radius, torch.ones_like(delta, dtype=torch.bool))


def step_reads(terms: torch.Tensor, group: int, tol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(value blocks read [Hkv, n], whether each query head needs none [Hq])`` for one layer
    step: per kv head, the union over its query heads of the fewest blocks whose ``terms [Hq,
    n]``, left out, leave the rest at most ``tol``."""
    sets = fewest_covering(terms, tol)
    return sets.view(-1, group, sets.shape[1]).any(dim=1), ~sets.any(dim=1)


class Tally:
    """Sums over head-steps for one (context, policy, budget); ``whole``: a block read is read
    whole (FP16 keys and values), else its values only."""

    def __init__(self, whole: bool = False) -> None:
        self.whole = whole
        self.steps = self.kept = self.blocks = self.heads = 0
        self.mass, self.e_val = [], []
        self.read = dict.fromkeys(TOLS, 0)
        self.read_evicted = dict.fromkeys(TOLS, 0)
        self.free = dict.fromkeys(TOLS, 0)

    def add(self, p, terms, evicted, group) -> None:
        """One layer step: block probabilities ``p [Hq, n, B]``, every completed block's value
        term ``terms [Hq, n]`` (the kept blocks' codec, the evicted ones' summary) and the
        ``evicted [n]`` mask."""
        self.steps += 1
        self.blocks += evicted.numel()
        self.kept += int((~evicted).sum())
        self.heads += p.shape[0]
        self.mass.append(p.sum(dim=-1)[:, evicted].sum(dim=1))
        self.e_val.append(terms.sum(dim=1))
        for tol in TOLS:
            read, free = step_reads(terms, group, tol)
            self.read[tol] += int(read.sum())
            self.read_evicted[tol] += int(read[:, evicted].sum())
            self.free[tol] += int(free.sum())

    def summary(self, hkv: int) -> dict:
        mass, e_val = torch.cat(self.mass), torch.cat(self.e_val)
        dense = 2 * self.blocks * hkv / (2 if self.whole else 1)  # dense KV, in blocks read
        return {
            "layer_steps": self.steps, "kept_fraction": self.kept / self.blocks,
            "evicted_mass": _quantiles(mass), "e_val_unread": _quantiles(e_val),
            # FP16 blocks read / the dense FP16 keys and values of the completed blocks
            "read_of_dense_kv": {str(t): self.read[t] / dense for t in TOLS},
            "evicted_share_of_reads": {str(t): self.read_evicted[t] / max(self.read[t], 1)
                                       for t in TOLS},
            "heads_reading_none": {str(t): self.free[t] / self.heads for t in TOLS},
        }


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    q = torch.quantile(x.double(), torch.tensor([0.5, 0.95], dtype=torch.float64))
    return {"p50": float(q[0]), "p95": float(q[1])}


class Capture:
    """The model's attention, dense (SDPA), with every decode step's query, keys and values
    handed to ``on_step(layer, q [Hq, d], k, v [Hkv, T, d] FP16, scaling)``."""

    def __init__(self, on_step) -> None:
        self.on_step = on_step

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        if query.shape[2] == 1:  # a decode step (batch 1)
            scaling = kwargs.get("scaling") or module.scaling
            self.on_step(module.layer_idx, query[0, :, 0].detach(), key[0].detach().half(),
                         value[0].detach().half(), float(scaling))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


class Frontier:
    """Per layer: a store per (summary, budget) (the streaming policy's real choices) kept in
    step with the model's cache; per decode step the tallies of no eviction and of both
    policies (values read, box summaries), and of no eviction and streaming per summary (blocks
    read whole, against certkv's key and value terms)."""

    def __init__(self, budgets, block: int) -> None:
        self.budgets, self.block = budgets, block
        self.stores: dict = {}
        self.tallies = {("none", 1.0): Tally(),
                        **{(pol, b): Tally() for pol in POLICIES for b in budgets}}
        self.whole = {("int8", 1.0): Tally(whole=True),
                      **{(summ, b): Tally(whole=True) for summ in KEY_SUMMARIES
                         for b in budgets}}
        self.delta = {name: [0.0, 0.0] for name in ("int8", *KEY_SUMMARIES, "keys4")}
        self.hkv = 0

    def on_step(self, layer, q, k, v, scaling) -> None:
        hkv = self.hkv = k.shape[0]
        group = q.shape[0] // hkv
        self._follow(layer, k, v)
        p = block_probabilities(q, k, scaling, self.block)
        kept, kept_bound = block_notes(k, v, self.block,
                                       KVQuantizer(block_size=self.block).precisions()[1])
        held = {name: block_notes(k, v, self.block, SUMMARIES.get(name)().precision())
                for name in (*KEY_SUMMARIES, "keys4")}  # every summary: the same value notes
        summary = held["box"][0]
        radius = torch.minimum(kept["nu"], kept["v_radius"]).amax(dim=-1)
        radius = radius.double().repeat_interleave(group)

        def values(evicted):
            eta, spectral = (torch.where(evicted, summary[name], kept[name]).double()
                             for name in ("eta", "value_spec"))
            return value_terms(p, eta, spectral, group)

        none = torch.zeros(p.shape[1], dtype=torch.bool)
        self.tallies["none", 1.0].add(p, values(none), none, group)
        int8 = key_deltas(q, scaling, kept, kept_bound)
        self.whole["int8", 1.0].add(p, key_terms(p, int8, radius) + values(none), none, group)
        self._note_delta("int8", p, int8)
        for budget in self.budgets:
            evicted = self.stores[layer, "box", budget].evicted_mask()[: p.shape[1]].cpu()
            self.tallies["streaming", budget].add(p, values(evicted), evicted, group)
            ideal = torch.ones_like(evicted)  # the same count, the most attended blocks kept
            ideal[p.sum(dim=(0, 2)).topk(int((~evicted).sum())).indices] = False
            self.tallies["topmass", budget].add(p, values(ideal), ideal, group)
        for name, (notes, bound) in held.items():
            loose = key_deltas(q, scaling, notes, bound)
            self._note_delta(name, p, loose)
            for budget in self.budgets if name in KEY_SUMMARIES else ():
                store = self.stores[layer, name, budget]
                if store is None:  # the summary alone exceeds this budget
                    continue
                evicted = store.evicted_mask()[: p.shape[1]].cpu()
                terms = key_terms(p, torch.where(evicted, loose, int8), radius)
                self.whole[name, budget].add(p, terms + values(evicted), evicted, group)

    def _note_delta(self, name: str, p: torch.Tensor, delta: torch.Tensor) -> None:
        """Add one layer step's ``Delta_b [Hq, n]``, weighted by the blocks' exact masses."""
        rho = p.sum(dim=-1)
        self.delta[name][0] += float((rho * delta).sum())
        self.delta[name][1] += float(rho.sum())

    def _follow(self, layer, k, v) -> None:
        """Append to each of the layer's stores what the model's cache gained since (a summary
        whose blocks alone exceed a budget gets no store there)."""
        for name in KEY_SUMMARIES:
            for budget in self.budgets:
                key = (layer, name, budget)
                if key not in self.stores:
                    policy = StreamingEviction(budget=budget, summary=name)
                    self.stores[key] = TieredKVStore(
                        k.shape[0], k.shape[2], block_size=self.block,
                        quantizer=KVQuantizer(block_size=self.block).with_eviction(policy))
                store = self.stores[key]
                if store is None:
                    continue
                new = k.shape[1] - store.num_tokens
                try:
                    store.append(k[:, -new:], v[:, -new:])
                except BudgetError:
                    self.stores[key] = None


def captured_decode(model: str, weights: str, context: int, steps: int, on_step,
                    name: str) -> str:
    """A dense prefill of ``context`` tokens of the default book, then ``steps`` teacher-forced
    decode steps, each layer's attention handing ``on_step`` its query, keys and values
    (:class:`Capture`, registered as ``name``); returns the weights used."""
    from transformers import AttentionInterface, DynamicCache

    from certkv.models.hook import cache_kwargs

    lm, used = _decode_model(model, weights, torch.device("cpu"), torch.float32)
    ids = _decode_prompt(lm, context + steps)
    AttentionInterface.register(name, Capture(on_step))
    lm.model.set_attn_implementation(name)
    cache = DynamicCache()
    with torch.no_grad():
        lm.model(torch.tensor([ids[:context]]), **cache_kwargs(lm.model, cache))
        for s in range(steps):
            lm.model(torch.tensor([[ids[context + s]]]), **cache_kwargs(lm.model, cache))
    return used


def frontier(model: str, context: int, steps: int, budgets, weights: str = "auto",
             block: int = 16) -> dict:
    """The tallies' summaries after ``steps`` teacher-forced decode steps on ``context`` tokens."""
    state = Frontier(budgets, block)
    used = captured_decode(model, weights, context, steps, state.on_step, "certkv_frontier")
    return {"model": model, "weights": used, "context": context, "steps": steps,
            "block": block, "tols": list(TOLS),
            "rows": [{"policy": pol, "budget": b, **t.summary(state.hkv)}
                     for (pol, b), t in state.tallies.items()],
            "whole_rows": [{"keys": name, "budget": b, **t.summary(state.hkv)}
                           for (name, b), t in state.whole.items() if t.steps],
            # each key codec's Delta_b (nats), the mean over every block weighted by its mass
            "key_delta": {name: a / w for name, (a, w) in state.delta.items()}}


def markdown(runs: list[dict], command: str, info: dict) -> str:
    """The report: one table per context."""
    lines = ["# Certified eviction's frontier: the values a certificate must read", "",
             *provenance(command, info), "",
             "Per (policy, Tier-1 budget): the completed blocks kept in Tier-1 (INT8 keys, INT4 "
             "values), the attention mass on the evicted ones (summaries: centre and radius) and "
             "the value term of every block with nothing read (medians over head-steps); for "
             "each tolerance, the fewest FP16 value blocks a certificate must read to bring that "
             "term within it on exact masses (the union over a kv head's query heads), as a "
             "share of the dense FP16 keys and values, the share of them that are evicted "
             "blocks, and the share of head-steps that need none.", ""]
    for run in runs:
        lines += [f"## {run['model']}, N = {run['context']}, {run['steps']} decode steps "
                  f"({run['weights']} weights)", "",
                  "| policy | budget | kept | evicted mass | E_val unread | tol | read / dense KV "
                  "| evicted of read | heads reading none |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        lines += _table_rows(run["rows"], run["tols"], lambda row: (
            f"{row['policy']} | {row['budget']:.0%} | {row['kept_fraction']:.2f} | "
            f"{row['evicted_mass']['p50']:.3f} | {row['e_val_unread']['p50']:.2f}"))
        deltas = ", ".join(f"{name} {x:.3g}" for name, x in run["key_delta"].items())
        lines += ["", f"Each key codec's `Delta_b` (nats; the mean over every completed block, "
                  f"weighted by its exact mass): {deltas}."]
        lines += ["", "With the key terms, blocks read whole (FP16 keys and values) against the "
                  "per-block TV bound's share of E_key on exact masses plus the value terms, for "
                  "streaming with each key summary (`int8`: no eviction; a summary whose blocks "
                  "alone exceed a budget has no row there):", "",
                  "| keys | budget | kept | tol | read / dense KV | evicted of read "
                  "| heads reading none |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += _table_rows(run["whole_rows"], run["tols"], lambda row: (
            f"{row['keys']} | {row['budget']:.0%} | {row['kept_fraction']:.2f}"))
        lines.append("")
    return "\n".join(lines)


def _table_rows(rows: list[dict], tols: list[float], lead) -> list[str]:
    """A markdown row per (row, tolerance): ``lead(row)``'s cells, the tolerance, the share of
    the dense KV bytes read, the evicted share of it and the head-steps that read none."""
    return [f"| {lead(row)} | {tol:g} | {row['read_of_dense_kv'][str(tol)]:.3f} | "
            f"{row['evicted_share_of_reads'][str(tol)]:.2f} | "
            f"{row['heads_reading_none'][str(tol)]:.2f} |" for row in rows for tol in tols]


def plot(runs: list[dict], path: Path) -> None:
    """Value bytes read against the tolerance, a line per (context, policy, budget)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run in runs:
        for row in run["rows"]:
            ys = [row["read_of_dense_kv"][str(t)] for t in run["tols"]]
            style = {"none": ":", "streaming": "-"}.get(row["policy"], "--")
            ax.plot(run["tols"], ys, style, marker="o",
                    label=f"N={run['context']} {row['policy']} {row['budget']:.0%}")
    ax.axhline(0.1, color="grey", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xlabel("tolerance on the value term (E_val)")
    ax.set_ylabel("FP16 values read / dense FP16 KV bytes")
    ax.set_title("Fewest FP16 values a certificate must read (exact masses)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per context")
    parser.add_argument("--budget", type=float, action="append")
    parser.add_argument("--weights", default="auto", choices=["auto", "real", "random"])
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    runs = [frontier(a.model, n, a.steps, a.budget or [0.25, 0.10], a.weights)
            for n in a.context or [4096]]
    publish("evict_frontier.py", runs, markdown, argv, a.out, "frontier")
    if a.out:
        plot(runs, a.out / "frontier.png")


def publish(script: str, runs: list[dict], markdown, argv, out: Path | None, stem: str) -> None:
    """Print ``markdown(runs, command, info)`` (the command that ran ``scripts/<script>``, the
    commit and device) and, with ``out``, write it there as README.md beside ``<stem>.json``
    (the command, the info and the runs), each atomically."""
    from certkv.provenance import source_commit

    info = {**device_info(), "commit": source_commit()}
    command = f"python scripts/{script} " + " ".join(argv or sys.argv[1:])
    text = markdown(runs, command, info)
    print(text)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "README.md", text + "\n")
        write_atomic(out / f"{stem}.json",
                     json.dumps({"command": command, **info, "runs": runs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
