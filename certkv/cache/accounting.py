"""What a store holds, in bytes (:class:`~certkv.cache.store.TieredKVStore` inherits this):
Tier-1 per precision and per block, the annotations, the FP16 tail, the decoded mirror,
Tier-2 and the dense cache of the same tokens. Reads the store's fields, never writes them
(``_block_bytes`` memoises one block's bytes per precision)."""

from __future__ import annotations

import torch


class ByteAccounting:
    """Byte counts of a store (Table 13's Tier-1 total, a budget's numerator)."""

    def block_bytes(self, pid: int) -> int:
        """Tier-1 bytes of one block at precision ``pid`` (codes and metadata, all kv heads)."""
        if pid not in self._block_bytes:
            zeros = torch.zeros(self.num_kv_heads, 1, self.block_size, self.head_dim,
                                dtype=torch.float16, device=self.device)
            precision = self.precisions[pid]
            keys = precision.key_codec.encode_at(zeros, torch.zeros(1, dtype=torch.long),
                                                 self._layer)
            values = precision.value_codec.encode_at(zeros, self._layer)
            self._block_bytes[pid] = sum(t.element_size() * t.numel()
                                         for t in (*keys.values(), *values.values()))
        return self._block_bytes[pid]

    def own_block_bytes(self) -> torch.Tensor:
        """FP64 ``[n_blocks]`` (host): each block's bytes at its precision, an evicted block's
        at the precision its stage would restore it to."""
        pids = self.block_precision.clone()
        evicted = self.evicted_mask()
        for pid, where in self._stage_pids(evicted.nonzero(as_tuple=True)[0]):
            pids[where] = pid
        return self.precision_block_bytes()[pids]

    def precision_block_bytes(self) -> torch.Tensor:
        """FP64 ``[P]`` (host): :meth:`block_bytes` of each precision id."""
        return torch.tensor([float(self.block_bytes(p)) for p in range(len(self.precisions))],
                            dtype=torch.float64)

    def tier1_bytes(self) -> int:
        """Codes + quantization metadata of completed blocks, exact windows' FP16 included
        (Table 13's Tier-1 total; what a budget limits).

        Table 13 lists eta_b as "<1 byte/token, amortised" and leaves it out of the 288-byte
        total; the annotations are counted by :meth:`annotation_bytes`.
        """
        return sum(self._table.precision_bytes())

    def precision_bytes(self) -> dict[str, int]:
        """Tier-1 bytes per precision name (e.g. ``exact``, ``quantized``; a tiered quantizer's
        ``hot``, ``warm``, ``archive-*``), live blocks only."""
        out: dict[str, int] = {}
        for precision, nbytes in zip(self.precisions, self._table.precision_bytes(),
                                     strict=True):
            out[precision.name] = out.get(precision.name, 0) + nbytes
        return out

    def annotation_bytes(self) -> int:
        """The :data:`ANNOTATIONS`: six FP32 (24 bytes) per block per kv head."""
        return self._annotations.nbytes()

    def tail_bytes(self) -> int:
        """FP16 partial tail block (device)."""
        return 2 * 2 * self.num_kv_heads * self.tail_len * self.head_dim

    def device_bytes(self) -> int:
        """What this store keeps in device memory for the step: Tier-1, annotations, tail (the
        decoded mirror, a CPU speed aid, is :meth:`workspace_bytes`)."""
        return self.tier1_bytes() + self.annotation_bytes() + self.tail_bytes()

    def tier2_bytes(self) -> int:
        """FP16 originals in host memory (Tier-2)."""
        return self._tier2.nbytes()

    def dense_bytes(self) -> int:
        """What a dense FP16 KV cache of the same tokens would hold."""
        return 2 * 2 * self.num_kv_heads * self.num_tokens * self.head_dim

    def workspace_bytes(self) -> int:
        """Device memory of the decoded mirror (0 without one)."""
        return 0 if self._mirror is None else self._mirror.nbytes()
