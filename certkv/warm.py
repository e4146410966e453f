"""Compile the CPU backend's numba kernels into numba's on-disk cache (``make setup`` runs it).

numba compiles a kernel the first time it runs with given argument types and keeps the machine
code beside its module (``__pycache__``, keyed by the source file, so an edited module compiles
again). Without a warm cache the first decode steps of every process pay that compilation, about
a minute on a 2-core machine, and a test run pays it once per worker, in parallel, for the same
kernels. :func:`warm` decodes a few steps of every quantizer option in ``conf/`` in each mode
(with a scratch cache, and once with eviction) on a small synthetic store, with the query dtypes
a model uses, so that later processes load the kernels instead.

``python -m certkv.warm`` runs it and prints how long it took.
"""

from __future__ import annotations

import time

import torch

from certkv.attention import CertifiedAttention
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.config import config_groups, option
from certkv.eval.runner import build
from certkv.quant.rope import RopeSpec

HEAD_DIM, KV_HEADS, GROUP = 64, 2, 2
TOKENS = 600  # past every configured window: tiers' hot and stale ages, KIVI's residual
MODES = ("dense", "naive", "certified")
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _component(group: str, name: str, *changes: str):
    """The component of ``conf/<group>/<name>.yaml`` with ``key=value`` changes."""
    return build(option(group, name, *changes), group)


def _decode(quantizer, mode: str, dtype: torch.dtype, steps: int = 2) -> None:
    """``steps`` decode steps of ``mode`` on a fresh store of ``quantizer`` (one token appended
    between steps), queries in ``dtype``."""
    gen = torch.Generator().manual_seed(0)
    attention, scratch = CertifiedAttention(mode=mode), ScratchCache(64, 64)
    store = TieredKVStore(KV_HEADS, HEAD_DIM, **quantizer.store_kwargs(),
                          decoded_mirror=attention.decoded_mirror(torch.device("cpu")))
    kv = torch.randn(2, KV_HEADS, TOKENS + steps, HEAD_DIM, generator=gen).half()
    store.append(kv[0, :, :TOKENS], kv[1, :, :TOKENS])
    q = torch.randn(KV_HEADS * GROUP, HEAD_DIM, generator=gen).to(dtype)
    for step in range(steps):
        attention(q, store, scratch=scratch)
        at = TOKENS + step
        store.append(kv[0, :, at:at + 1], kv[1, :, at:at + 1])


def warm() -> int:
    """Run :func:`_decode` over every quantizer option, mode and query dtype (and the default
    quantizer with eviction); returns the number of decodes run."""
    rope = RopeSpec.from_theta(1e4, HEAD_DIM)
    runs = 0
    for name in config_groups()["quantizer"]:
        quantizer = _component("quantizer", name).with_rope(rope)
        for mode in MODES:
            for dtype in QUERY_DTYPES:
                _decode(quantizer, mode, dtype)
                runs += 1
    policy = _component("evict", "age", "budget=0.5", "min_materialized=32")
    for mode in MODES[1:]:
        _decode(_component("quantizer", "int8_int4").with_rope(rope).with_eviction(policy), mode,
                torch.float32)
        runs += 1
    return runs


if __name__ == "__main__":
    start = time.perf_counter()
    count = warm()
    print(f"certkv: {count} decodes compiled numba's kernels into its cache in "
          f"{time.perf_counter() - start:.0f} s")
