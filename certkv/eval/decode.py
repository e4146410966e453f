"""Token-by-token decoding through a tiered cache, and the shared dense prefill (paper 8).

Free of Hydra so that ``certkv bench`` runs where only torch, transformers, typer and rich are
installed (the lent GPU machines).
"""

from __future__ import annotations

import time

import torch

from certkv.attention import CertifiedAttention
from certkv.cache.hf import CacheSpec, TieredCache
from certkv.models.loading import LoadedModel
from certkv.quant import KVQuantizer


class Decoder:
    """Feeds one token at a time through the model with a tiered cache; times each step."""

    def __init__(self, lm: LoadedModel, cache: TieredCache) -> None:
        self.lm, self.cache, self.tokenizer = lm, cache, lm.tokenizer
        self.step_ms: list[float] = []

    @torch.inference_mode()
    def step(self, token: int) -> torch.Tensor:
        """Decode ``token``; returns FP32 logits ``[vocab]`` of the next token."""
        ids = torch.tensor([[token]], device=self.lm.device)
        _sync(self.lm.device)
        start = time.perf_counter()
        out = self.lm.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        _sync(self.lm.device)
        self.step_ms.append(1e3 * (time.perf_counter() - start))
        return out.logits[0, -1].float()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def prefill(lm: LoadedModel, prefix: list[int], block_size: int, spec: CacheSpec) -> TieredCache:
    """Dense prefill of ``prefix`` into a cache of FP16 originals (paper 8)."""
    cache = TieredCache(lm.num_layers, CertifiedAttention(mode="dense"),
                        KVQuantizer.fp16(block_size), spec)
    if prefix:
        ids = torch.tensor([prefix], device=lm.device)
        lm.model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache
