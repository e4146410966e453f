"""How tightly a summary of an evicted block's keys bounds its logits (issue 56): the summaries
certkv ships and the forms the issue proposes, on real decode steps.

A certificate knows an evicted block's attention mass only within ``e^{Delta_b}`` (eq. 8), so
the logit bound ``Delta_b`` a summary allows decides how many evicted blocks a small bound must
read back (``reports/evict/frontier``). For each summary of a block's ``B`` keys: the Tier-1
bytes it takes per block and kv head, and ``Delta`` (nats) on every completed block of every
layer and head, weighted by the block's (or token's) exact FP64 attention mass. Rows:

* ``int8``, ``keys4``, ``keys2``, ``box``: what certkv's codecs bound (their channel bounds
  with their rounding, tightened as the step tightens them: ``key_deltas`` of
  ``evict_frontier.py``); ``int8`` is a kept block's key codec, for scale;
* ``box/S``: the box over sub-blocks of ``S`` tokens (smaller summary blocks);
* ``pcaP``: a centre (the keys' mean), the ``P`` leading principal directions ``u_i`` of the
  centred keys with each coordinate's range, and the largest residual norm ``rho``: every token
  scored at the centre plus the ranges' midpoints, within ``sum_i |q . u_i| w_i / 2 + ||q_perp||
  rho`` (``q_perp``: ``q`` off the directions; the residuals lie there);
* ``pcaP+2b``: the same with each token's coordinates at 2 bits (within a sixth of each range);
* ``pcaP+2b+norms``: and each token's own residual norm (a per-token bound).

The proposed forms are evaluated in FP64 without the roundings an implementation would add
(``Delta`` here is at most what one would certify); bytes assume FP16 centres, directions,
ranges and norms and an FP32 radius. Per the module's measurements, a form is worth building
only if it bounds logits more tightly than ``keys2`` for about its bytes.

    .venv/bin/python scripts/summary_bounds.py [--context 4096] [--steps 4] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from evict_frontier import (
    block_notes,
    block_probabilities,
    captured_decode,
    key_deltas,
    publish,
)

from certkv.bench.tables import provenance
from certkv.quant import KVQuantizer
from certkv.registry import SUMMARIES

SHIPPED = ("int8", "keys4", "keys2", "box")
PROPOSED = ("box/8", "box/4", "pca2", "pca4", "pca8", "pca4+2b", "pca8+2b", "pca8+2b+norms")
FP64_MARGIN = 1 + 2.0**-40  # the FP64 evaluation's own rounding, added to every bound here


def shipped_precision(name: str, block: int):
    """The precision whose key codec certkv uses for ``name``: a kept block's (``int8``) or
    a registered summary's."""
    if name == "int8":
        return KVQuantizer(block_size=block).precisions()[1]
    return SUMMARIES.get(name)().precision()


def shipped_bytes(name: str, d: int, block: int) -> int:
    """Tier-1 key bytes per block and kv head of a shipped summary (the codecs' formats)."""
    bits = {"int8": 8, "keys4": 4, "keys2": 2}.get(name)
    return 4 * d if bits is None else block * d * bits // 8 + 8 * d


def proposed_bytes(name: str, d: int, block: int) -> int:
    """Tier-1 key bytes per block and kv head of a proposed form (FP16 storage, FP32 radius)."""
    if name.startswith("box/"):
        return 4 * d * (block // int(name[4:]))
    dims = int(name[3:].split("+")[0])
    size = 2 * d + 2 * dims * d + 4 * dims + 4  # centre, directions, ranges, radius
    if "+2b" in name:
        size += block * dims * 2 // 8
    if "norms" in name:
        size += 2 * block
    return size


def proposed(name: str, qg: torch.Tensor, kb: torch.Tensor, scaling: float
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(keys scored [Hkv, n, B, d], Delta per token [Hkv, G, n, B])`` of form ``name`` for
    queries ``qg [Hkv, G, d]`` and FP64 keys ``kb [Hkv, n, B, d]``: what a certificate built on
    the form would score each token at, and how far its logit may be from that."""
    if name.startswith("box/"):
        return _sub_boxes(qg, kb, int(name[4:]), scaling)
    dims = int(name[3:].split("+")[0])
    centre = kb.mean(dim=2, keepdim=True)
    y = kb - centre
    basis = torch.linalg.svd(y, full_matrices=False).Vh[:, :, :dims]  # [Hkv, n, P, d]
    coords = torch.einsum("hntd,hnpd->hntp", y, basis)
    low, high = coords.amin(dim=2, keepdim=True), coords.amax(dim=2, keepdim=True)
    if "+2b" in name:  # 2-bit coordinates: within a sixth of the range
        step = (high - low) / 3
        held = low + torch.round((coords - low) / step.clamp_min(1e-300)) * step
        half = step / 2
    else:
        held, half = ((low + high) / 2).expand_as(coords), (high - low) / 2
    residual = y - torch.einsum("hntp,hnpd->hntd", coords, basis)
    norms = residual.norm(dim=-1)  # [Hkv, n, B]
    if "norms" not in name:
        norms = norms.amax(dim=-1, keepdim=True).expand_as(norms)
    qu = torch.einsum("hgd,hnpd->hgnp", qg, basis)
    q_perp = (qg.norm(dim=-1)[:, :, None] ** 2 - (qu**2).sum(-1)).clamp_min(0).sqrt()
    along = (qu.abs() * half.squeeze(2).unsqueeze(1)).sum(-1)  # [Hkv, G, n]
    delta = (along.unsqueeze(-1) + q_perp.unsqueeze(-1) * norms.unsqueeze(1)) \
        * scaling * FP64_MARGIN
    scored = centre + torch.einsum("hntp,hnpd->hntd", held, basis)
    return scored, delta


def _sub_boxes(qg, kb, size: int, scaling: float):
    """The box over sub-blocks of ``size`` tokens: midpoints, ``sum_c |q_c| (u_c - l_c) / 2``."""
    hkv, n, block, d = kb.shape
    sub = kb.reshape(hkv, n, block // size, size, d)
    low, high = sub.amin(dim=3, keepdim=True), sub.amax(dim=3, keepdim=True)
    scored = ((low + high) / 2).expand_as(sub).reshape(kb.shape)
    half = ((high - low) / 2).squeeze(3)  # [Hkv, n, S', d]
    delta = torch.einsum("hgd,hnsd->hgns", qg.abs(), half) * scaling * FP64_MARGIN
    return scored, delta.repeat_interleave(size, dim=-1)


class Tally:
    """Mass-weighted sums of ``Delta`` per summary over head-steps."""

    def __init__(self, block: int) -> None:
        self.block = block
        self.sums: dict = {}
        self.d = 0

    def on_step(self, layer, q, k, v, scaling) -> None:
        hkv, _, d = k.shape
        self.d = d
        p = block_probabilities(q, k, scaling, self.block)  # [Hq, n, B]
        n = p.shape[1]
        kb = k[:, : n * self.block].double().reshape(hkv, n, self.block, d)
        qg = q.double().view(hkv, -1, d)
        for name in SHIPPED:
            notes, bound = block_notes(k, v, self.block, shipped_precision(name, self.block))
            delta = key_deltas(q, scaling, notes, bound)  # [Hq, n]
            self._add(name, p, delta.unsqueeze(-1).expand_as(p))
        for name in PROPOSED:
            _, delta = proposed(name, qg, kb, scaling)
            self._add(name, p, delta.reshape(p.shape))

    def _add(self, name: str, p: torch.Tensor, delta: torch.Tensor) -> None:
        """One layer step's per-token ``Delta [Hq, n, B]`` weighted by the exact ``p``."""
        s = self.sums.setdefault(name, [0.0, 0.0, 0.0, 0.0])
        s[0] += float((p * delta).sum())
        s[1] += float(p.sum())
        s[2] += float(p[delta <= 0.5].sum())
        s[3] += float(p[delta <= 2.0].sum())

    def rows(self) -> list[dict]:
        out = []
        for name, (weighted, mass, tight, loose) in self.sums.items():
            size = (shipped_bytes(name, self.d, self.block) if name in SHIPPED
                    else proposed_bytes(name, self.d, self.block))
            out.append({"summary": name, "shipped": name in SHIPPED, "bytes": size,
                        "delta": weighted / mass, "mass_within_0.5": tight / mass,
                        "mass_within_2": loose / mass})
        return out


def summary_bounds(model: str, context: int, steps: int, weights: str = "auto",
                   block: int = 16) -> dict:
    """Every summary's mass-weighted ``Delta`` over ``steps`` teacher-forced decode steps after
    a dense prefill of ``context`` tokens of the default book."""
    tally = Tally(block)
    used = captured_decode(model, weights, context, steps, tally.on_step,
                           "certkv_summary_bounds")
    return {"model": model, "weights": used, "context": context, "steps": steps,
            "block": block, "head_dim": tally.d, "rows": tally.rows()}


def markdown(runs: list[dict], command: str, info: dict) -> str:
    lines = ["# Key summaries of evicted blocks: bytes against the logit bound", "",
             *provenance(command, info), "",
             "Per summary: Tier-1 key bytes per block and kv head, and `Delta` (nats: the "
             "block's logits are known within it, its mass within `e^Delta`), its mean over "
             "every completed block of every layer and query head weighted by the exact "
             "attention mass, and the share of that mass on blocks (tokens, for per-token "
             "bounds) with `Delta` at most 0.5 and 2 nats. shipped: a codec certkv has "
             "(`int8`: a kept block's keys); the others are the forms issue 56 proposes, in "
             "FP64 without an implementation's roundings (`scripts/summary_bounds.py`).", ""]
    for run in runs:
        lines += [f"## {run['model']}, N = {run['context']}, {run['steps']} decode steps "
                  f"(d = {run['head_dim']}, B = {run['block']}, {run['weights']} weights)", "",
                  "| summary | shipped | key bytes | Delta (nats) | mass within 0.5 "
                  "| mass within 2 |", "| --- | --- | --- | --- | --- | --- |"]
        for row in run["rows"]:
            lines.append(f"| {row['summary']} | {'yes' if row['shipped'] else 'no'} | "
                         f"{row['bytes']} | {row['delta']:.3g} | "
                         f"{row['mass_within_0.5']:.2f} | {row['mass_within_2']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--context", type=int, action="append")
    parser.add_argument("--steps", type=int, default=4, help="decode steps per context")
    parser.add_argument("--weights", default="auto", choices=["auto", "real", "random"])
    parser.add_argument("--out", type=Path, default=None)
    a = parser.parse_args(argv)
    runs = [summary_bounds(a.model, n, a.steps, a.weights) for n in a.context or [4096]]
    publish("summary_bounds.py", runs, markdown, argv, a.out, "summary_bounds")


if __name__ == "__main__":
    main()
