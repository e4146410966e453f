"""SnapKV: keep what an observation window at the end of the prompt attends to.

At prefill the last ``window`` queries of the prompt score every prompt token: their softmax
attention over the prompt's keys (causal), averaged over the window's queries and the query
heads of each kv head, smoothed along the sequence by an average pool of ``kernel`` tokens (the
clusters SnapKV keeps). A block's score is its tokens' sum, averaged over kv heads (the store
evicts a block for all kv heads at once). The blocks of the window itself stay; blocks completed
after the prompt rank above every prompt block, newest first, so a long decode evicts prompt
blocks in the order SnapKV ranked them.

The queries come from the model (:func:`certkv.models.hook.certkv_attention` on a certkv cache,
or the evaluation's dense prefill): :meth:`TieredKVStore.observe_prompt`. Until it has seen them
the policy does not evict; a store whose prompt was never scored cannot evict by SnapKV and says
so at its next eviction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from certkv.errors import ConfigError, require
from certkv.evict.base import EvictionPolicy
from certkv.registry import EVICTION_POLICIES


@EVICTION_POLICIES.register("snapkv")
@dataclass
class SnapKVEviction(EvictionPolicy):
    """Keep the observation window and the prompt blocks its queries attend to most."""

    window: int = 32
    kernel: int = 5
    name = "snapkv"

    def __post_init__(self) -> None:
        super().__post_init__()
        require(isinstance(self.window, int) and self.window >= 1, ConfigError,
                f"evict.window={self.window!r} must be a positive number of prompt queries, "
                "e.g. 32.")
        require(isinstance(self.kernel, int) and self.kernel >= 1 and self.kernel % 2 == 1,
                ConfigError, f"evict.kernel={self.kernel!r} must be an odd pooling width in "
                "tokens, e.g. 5.")

    @property
    def prompt_window(self) -> int:
        return self.window

    def prompt_scores(self, store, queries: torch.Tensor, scaling: float) -> torch.Tensor:
        """FP64 ``[n_blocks]`` (host): each completed block's share of the window's attention.

        Args:
            queries: ``[Hq, T, d]`` the prompt's queries (after RoPE, as the model attends);
                the last ``window`` of them are the window, at the last positions of the store.
            scaling: the model's softmax scale.
        """
        hkv, n_tok = store.num_kv_heads, store.num_tokens
        hq, t, d = queries.shape
        w = min(self.window, t, n_tok)
        q = queries[:, t - w:].float().reshape(hkv, hq // hkv, w, d)
        k, _ = store.dense_kv()  # [Hkv, N, d] FP16 originals
        s = torch.einsum("kgwd,knd->kgwn", q.to(k.device), k.float()) * scaling
        pos = torch.arange(n_tok, device=s.device)
        future = pos.view(1, -1) > (n_tok - w + torch.arange(w, device=s.device)).view(-1, 1)
        p = torch.softmax(s.masked_fill(future, float("-inf")), dim=-1).mean(dim=(1, 2))
        pooled = F.avg_pool1d(p.unsqueeze(1), self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False).squeeze(1)  # [Hkv, N]
        nb, b = store.num_blocks, store.block_size
        return pooled[:, : nb * b].reshape(hkv, nb, b).sum(dim=-1).mean(dim=0).double().cpu()

    @staticmethod
    def _require_prompt(tracker) -> None:
        require(tracker.prompt_scores is not None, ConfigError,
                "evict=snapkv ranks blocks by the prompt's last queries, which this store never "
                "saw; call store.observe_prompt(queries, scaling) after appending the prompt (the "
                "model hook and `certkv run` do), or choose another evict policy.")

    def protected(self, store, tracker) -> torch.Tensor:
        """The blocks of the observation window (the prompt's last ``window`` tokens)."""
        self._require_prompt(tracker)
        start = torch.arange(store.num_blocks) * store.block_size
        end = tracker.prompt_tokens
        return (start + store.block_size > end - self.window) & (start < end)

    def scores(self, store, tracker) -> torch.Tensor:
        self._require_prompt(tracker)
        n = store.num_blocks
        seen = tracker.prompt_scores[:n]
        later = torch.arange(n - seen.numel(), dtype=torch.float64) + 2.0  # above any share
        return torch.cat([seen, later])
