"""Reading a store's FP16 originals (Tier-2, host memory; :class:`~certkv.cache.store.
TieredKVStore` inherits this): per block for promotion and page-in, as rows for the kernels
that read them in place, and whole for dense attention (rungs 3-4, ``mode=dense``)."""

from __future__ import annotations

import torch

from certkv.cache.blocks import head_rows
from certkv.errors import Tier2UnavailableError, require
from certkv.quant import Blocks

TIER2_MISSING = (
    "the FP16 originals (Tier-2) of this store were dropped, so no block can be promoted and no "
    "dense fallback can run; build the store with keep_originals=True."
)


class Tier2Reads:
    """The originals a step reads when the certificate asks for exactness."""

    def _originals(self, extra: int = 0) -> Blocks:
        """FP16 originals ``k, v: [Hkv, n, B, d]`` of completed blocks: Tier-2 in host memory,
        or Tier-1 itself for a lossless store (with ``extra`` spare blocks)."""
        if self.lossless:
            return {"k": self._single_view("key", extra)["data"],
                    "v": self._single_view("value", extra)["data"]}
        require(self.keep_originals, Tier2UnavailableError, TIER2_MISSING)
        return self._tier2.view()

    def originals(self) -> Blocks:
        """FP16 originals ``k, v: [Hkv, n, B, d]`` of the completed blocks, in place (Tier-2 in
        host memory, pinned on CUDA, or Tier-1 of a lossless store; empty without blocks):
        what the on-device fallback kernel reads."""
        return self._originals() if self.num_blocks else {}

    def original_rows(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """The completed blocks' FP16 originals as row views ``k, v: [Hkv * W, B, d]`` of the
        buffers in place (pinned host memory on CUDA) and ``W``: block ``b`` of kv head ``h``
        is row ``h * W + b``. What kernels that page in on the device read (made again only
        when the originals' views change: every block completion)."""
        originals = self._originals()
        if self._rows is None or self._rows[0] is not originals:
            (k, width), (v, _) = (head_rows(originals[name]) for name in ("k", "v"))
            self._rows = (originals, (k, v, width))
        return self._rows[1]

    def fetch_originals(
        self, kv_heads: torch.Tensor, blocks: torch.Tensor, which: str = "kv"
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Page in FP16 originals of ``(kv_heads[i], blocks[i])`` pairs from Tier-2.

        Returns ``(k, v)``, each ``[P, B, d]`` FP16 on the store's device, or ``None`` where
        ``which`` does not ask for it (``"k"``, ``"v"`` or ``"kv"``).
        """
        originals = self._originals()
        where = self.device if self.lossless else torch.device("cpu")  # where originals live
        heads, blks = kv_heads.to(where), blocks.to(where)
        fetched = []
        for name in ("k", "v"):
            if name in which:
                fetched.append(originals[name][heads, blks].to(self.device, non_blocking=True))
            else:
                fetched.append(None)
        return fetched[0], fetched[1]

    def dense_kv(self, kv_heads: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 originals of every token (Tier-2 + tail) on the device (rungs 3-4, dense mode).

        Returns ``k, v: [h, N, d]`` for the requested ``kv_heads`` (all ``Hkv`` by default);
        only those heads are paged in.
        """
        if self.lossless and kv_heads is None:
            return self._dense_view()
        tail_k, tail_v = self.tail()
        if kv_heads is not None:
            tail_k, tail_v = tail_k[kv_heads], tail_v[kv_heads]
        if self.num_blocks == 0:
            return tail_k, tail_v
        originals = self._originals()
        heads = slice(None) if kv_heads is None else kv_heads.to(originals["k"].device)
        k = originals["k"][heads].flatten(1, 2).to(self.device, non_blocking=True)
        v = originals["v"][heads].flatten(1, 2).to(self.device, non_blocking=True)
        return torch.cat([k, tail_k], dim=1), torch.cat([v, tail_v], dim=1)

    def _dense_view(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Lossless store: every token as ``[Hkv, N, d]`` views of Tier-1 (the tail is copied
        into the spare block; no copy of the cache, as a dense FP16 KV cache would hold it)."""
        extra = 1 if self.tail_len else 0
        originals = self._originals(extra)
        if extra:
            for name, tail in zip(("k", "v"), self.tail(), strict=True):
                originals[name][:, -1, : self.tail_len] = tail
        n = self.num_tokens
        return originals["k"].flatten(1, 2)[:, :n], originals["v"].flatten(1, 2)[:, :n]
