"""Measure what sets E_val's scale on a model: its value vectors' norms and the INT4 value
codec's per-block error ``eta_b`` (Cor. 4.2), after a dense prefill through the certified cache.

``E_val = sum_b rho_b eta_b`` over the blocks whose values stay quantized is in the values' own
units, so two models with the same codec and policy can differ in E_val by the ratio of their
value norms. Prints (and with ``--out`` writes) JSON quantiles (5/50/95%) of the per-token value
L2 norm, of ``eta_b`` and of ``eta_b`` over the block's largest value norm (the codec's relative
error), over every layer and kv head.

    .venv/bin/python scripts/value_scale.py [--model smollm2_135m] [--context 4096] [--out F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from certkv.bench.decode import _decode_model, _decode_prompt
from certkv.eval.decode import Method, Prefill
from certkv.files import write_atomic

QUANTILES = (5, 50, 95)


def value_scale(model: str, context: int, weights: str = "auto") -> dict:
    """The quantiles above for ``model`` after ``context`` tokens of the default book."""
    lm, used = _decode_model(model, weights, torch.device("cpu"), torch.float32)
    ids = _decode_prompt(lm, context)
    cache = Prefill(lm, ids).session(Method.build("certified", "certified")).decoder().cache
    norms, etas, rel = [], [], []
    for layer in cache.layers:
        store = layer.stores[0]
        v = store.dense_kv()[1].float()  # [Hkv, T, d] the FP16 originals
        eta, bsz = store.eta, store.block_size  # [Hkv, n]: completed blocks
        n = eta.shape[1]
        norm = v.norm(dim=-1)  # [Hkv, T]
        block_max = norm[:, : n * bsz].reshape(-1, n, bsz).amax(dim=-1)
        norms.append(norm.flatten())
        etas.append(eta.flatten())
        rel.append((eta / block_max).flatten())
    return {"model": model, "weights": used, "context": context,
            "head_dim": store.head_dim, "layers": len(cache.layers),
            "quantizer": store.quantizer.label,
            "value_norm": _quantiles(norms), "eta_b": _quantiles(etas),
            "eta_b_relative": _quantiles(rel)}


def _quantiles(parts: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat(parts).double().numpy()
    return {f"p{p}": float(np.quantile(x, p / 100)) for p in QUANTILES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2_135m")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--weights", default="auto", choices=["auto", "real", "random"])
    parser.add_argument("--out", default=None, help="also write the JSON here")
    args = parser.parse_args()
    text = json.dumps(value_scale(args.model, args.context, args.weights), indent=1) + "\n"
    print(text, end="")
    if args.out:
        write_atomic(Path(args.out), text)


if __name__ == "__main__":
    main()
