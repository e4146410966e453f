"""transformers integration: a ``Cache`` whose layers are :class:`TieredKVStore` objects.

``TieredCache.update`` appends the new post-RoPE keys/values to the layer's store and returns a
:class:`StoreHandle` instead of tensors; the registered ``certkv`` attention function
(``certkv.models.hook``) receives that handle as ``key`` and runs dense SDPA for prefill and
:class:`CertifiedAttention` for every single-token decode step. Works with ``model(...)`` loops
and ``model.generate(...)``, for one sequence or a left-padded batch (one store per sequence
and layer, :meth:`~certkv.attention.CertifiedAttention.batch`; padding never enters a store),
sampled, greedy or by beam search (:meth:`~certkv.models.tiered_layer.TieredLayer.
reorder_cache`). Its layers are :class:`~certkv.models.tiered_layer.TieredLayer` objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache

from certkv.attention import CertifiedAttention
from certkv.cache import thresholds
from certkv.cache.scratch import ScratchStats
from certkv.cache.store import TieredKVStore
from certkv.certify.certificate import CertificateLog
from certkv.errors import CertKVError, ConfigError, require
from certkv.models.tiered_layer import StoreHandle, TieredLayer, beam_sources
from certkv.quant.importance import ImportanceBoard
from certkv.quant.kv import KVQuantizer

__all__ = ["BYTES_PER_ELEMENT", "CacheSpec", "CacheTelemetry", "StoreHandle", "TieredCache",
           "TieredLayer", "free_memory"]  # the layer's classes live in certkv.models.tiered_layer

# bytes a cache keeps per FP16 key or value element, an upper estimate: Tier-1 (at most the
# FP16 size), Tier-2 (FP16) and a CPU store's decoded mirror (FP32)
BYTES_PER_ELEMENT = 2 + 2 + 4


def free_memory(device: torch.device) -> int | None:
    """Bytes free now on ``device`` (a CPU: the host's available memory, page cache the kernel
    would reclaim included: ``MemAvailable``), None where unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as info:
            for line in info:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


@dataclass
class CacheSpec:
    """The ``cache`` config group: scratch capacities (blocks, per layer) and telemetry."""

    scratch_key_blocks: int = 2048
    scratch_value_blocks: int = 2048
    records: str = "summary"  # "summary": per-step summaries; "full": also every head

    def __post_init__(self) -> None:
        require(self.records in ("summary", "full"), ConfigError,
                f"cache.records={self.records!r} is unknown; use 'summary' or 'full'.")


@dataclass
class CacheTelemetry:
    """What a finished cache leaves for its certificate record, without its tensors: the
    certificate log, the byte accounting and the scratch counters."""

    log: CertificateLog
    bytes: dict[str, int]
    scratch: ScratchStats
    eviction: dict[str, int] = field(default_factory=dict)  # summed over layers


class TieredCache(Cache):
    """A transformers ``Cache`` over one :class:`TieredKVStore` per decoder layer.

    Args:
        num_layers: decoder layers of the model.
        attention: the certified attention (its ``mode`` picks dense / naive / certified,
            its ``decoded_mirror(device)`` what the stores keep decoded).
        quantizer: Tier-1 codecs and block size.
        spec: scratch capacities and telemetry level.
    """

    def __init__(self, num_layers: int, attention: CertifiedAttention,
                 quantizer: KVQuantizer | None = None, spec: CacheSpec | None = None) -> None:
        self.attention = attention
        self.quantizer = (quantizer or KVQuantizer()).for_mode(attention.mode)
        self.spec = spec or CacheSpec()
        self.log = CertificateLog(self.spec.records)
        self._loaded: dict[int, list[int]] = {}  # boundaries for stores made later
        self.board = ImportanceBoard()  # SmartKV's cross-layer state (unused by the others)
        # (layer, certificate) of the step certkv.graphs.GraphedDecode is capturing, or None;
        # while set, decode tokens are written at device positions (append_in_place)
        self.captured: list | None = None
        self._defer_commit = False
        self._sequence_logs: list[CertificateLog] = []  # a batch's, one per sequence
        self._left_logs: list[CertificateLog] = []  # those of sequences that left the batch
        super().__init__(layers=[TieredLayer(self, i) for i in range(num_layers)])

    @property
    def defer_commit(self) -> bool:
        """Every store's :attr:`TieredKVStore.defer_commit` (a full tail block kept until the
        next token; :class:`~certkv.graphs.GraphedDecode` sets it): the stores now, and those
        made later."""
        return self._defer_commit

    @defer_commit.setter
    def defer_commit(self, value: bool) -> None:
        self._defer_commit = value
        for store in self.stores():
            store.defer_commit = value

    def clone_as(self, attention: CertifiedAttention, quantizer: KVQuantizer | None = None,
                 spec: CacheSpec | None = None) -> TieredCache:
        """A new cache holding the same tokens (from the FP16 originals) for another method, so
        one dense prefill can serve several methods."""
        with torch.inference_mode():  # the source may hold inference tensors (prefill)
            states = [None if s is None else s.dense_kv() for s in
                      (layer.store for layer in self.layers)]
        return TieredCache.from_states(states, attention, quantizer, spec or self.spec)

    def copy_for(self, attention: CertifiedAttention,
                 spec: CacheSpec | None = None) -> TieredCache:
        """A new cache for ``attention`` holding independent copies of this cache's stores
        (:meth:`TieredKVStore.clone`: Tier-1 codes, annotations, Tier-2, tail), so one quantized
        prefill serves every method with the same quantizer without quantizing it again. Fresh
        scratch caches and certificate log."""
        cache = TieredCache(len(self.layers), attention, self.quantizer, spec or self.spec)
        require(cache.quantizer == self.quantizer, ConfigError,
                f"copy_for needs a method with this cache's quantizer ({self.quantizer.label}); "
                "build a cache from the prefill states for another one.")
        for mine, theirs in zip(cache.layers, self.layers, strict=True):
            if theirs.stores:
                mine.stores = mine._copies(theirs.stores)
                mine.sequences, mine.batched = list(theirs.sequences), theirs.batched
                mine.scratches = [mine._new_scratch() for _ in mine.stores]
                mine.positions = theirs.positions
                mine.dtype, mine.device = theirs.dtype, theirs.device
                mine.is_initialized = True
                mine._inference = torch.is_inference_mode_enabled()
        return cache

    @classmethod
    def from_states(cls, states: list, attention: CertifiedAttention,
                    quantizer: KVQuantizer | None = None,
                    spec: CacheSpec | None = None, queries: dict | None = None
                    ) -> TieredCache:
        """A cache holding given keys and values: ``states[i]`` is layer ``i``'s ``(k, v)``,
        each ``[Hkv, T, d]`` (or ``[1, Hkv, T, d]``), or None for an empty layer (e.g. the
        prefill states of a model's own cache). ``queries``: layer -> ``(q [Hq, T', d],
        scaling)``, the prompt's last queries, for an eviction policy that ranks by them
        (:class:`~certkv.models.hook.PromptQueries`)."""
        cache = cls(len(states), attention, quantizer, spec)
        for layer, state in zip(cache.layers, states, strict=True):
            if state is not None:
                k, v = (x if x.dim() == 4 else x[None] for x in state)
                layer.update(k, v)
                if queries and layer.layer_idx in queries:
                    layer.store.observe_prompt(*queries[layer.layer_idx])
        return cache

    def boundaries(self) -> dict[int, list[int]]:
        """Layer -> its store's stage ages (``[hot, stale]`` for a tiered quantizer)."""
        return {layer.layer_idx: layer.store.boundaries for layer in self.layers
                if layer.store is not None}

    def save_thresholds(self, path, model: str) -> None:
        """Persist :meth:`boundaries` for ``model`` (JSON, :func:`certkv.cache.thresholds.save`)."""
        thresholds.save(path, model, self.boundaries())

    def load_thresholds(self, path, model: str) -> None:
        """Set every layer's boundaries from those saved for ``model``; layers whose store does
        not exist yet take them when it is made."""
        self._loaded = thresholds.load(path, model)
        for layer in self.layers:
            for store in layer.stores if layer.layer_idx in self._loaded else ():
                store.boundaries = self._loaded[layer.layer_idx]

    def stores(self) -> list[TieredKVStore]:
        """Every layer's stores (a batch's: every sequence's, layer by layer)."""
        return [store for layer in self.layers for store in layer.stores]

    def advance_replayed(self) -> None:
        """The host half of a replayed decode step (:class:`~certkv.graphs.GraphedDecode`), whose
        appends wrote each token on the device: every store's tail count
        (:meth:`TieredKVStore.advance_tail`) and every layer's position count, as the eager
        step's :meth:`TieredLayer.update` leaves them."""
        for layer in self.layers:
            layer.positions += 1
            for store in layer.stores:
                store.advance_tail()

    def check_memory(self, batch: int, elements: int, device: torch.device) -> None:
        """Before a batch's prefill allocates: its caches (every layer: Tier-1 codes,
        annotations, Tier-2 FP16 originals and a CPU store's decoded mirror, estimated at
        :data:`BYTES_PER_ELEMENT` bytes per key or value element of the prompt) must fit the
        memory free now, or the batch is refused in one sentence before anything is lost."""
        need = BYTES_PER_ELEMENT * 2 * elements * batch * len(self.layers)
        free = free_memory(device)
        require(free is None or need <= free, CertKVError,
                f"a batch of {batch} prompts needs about {need / 2**30:.1f} GiB for its caches "
                f"but {free / 2**30:.1f} GiB are free on {device}; decode a smaller batch (or "
                "shorter prompts).")

    def sequence_logs(self, batch: int) -> list[CertificateLog]:
        """One certificate log per sequence of a batch (made at its first step, following
        its sequence when others leave); the cache's :attr:`log` summarises each step over
        the whole batch."""
        if not self._sequence_logs:
            self._sequence_logs = [CertificateLog(self.spec.records) for _ in range(batch)]
        require(len(self._sequence_logs) == batch, CertKVError,
                f"this cache logs {len(self._sequence_logs)} sequences but the step had "
                f"{batch}; start a new cache for a new batch.")
        return self._sequence_logs

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices``: the others leave the batch (their stores are
        dropped, their certificate logs kept for :meth:`telemetry`)."""
        super().batch_select_indices(indices)
        if self._sequence_logs:
            keep = [int(i) for i in indices]
            self._left_logs += [log for i, log in enumerate(self._sequence_logs)
                                if i not in keep]
            self._sequence_logs = [self._sequence_logs[i] for i in keep]

    def reorder_cache(self, beam_idx) -> None:
        """Beam search (:meth:`TieredLayer.reorder_cache` on every layer): each sequence's
        certificate log follows its beam too, copied where several beams continue one
        sequence (a beam's log holds its own history); a sequence no beam chooses leaves with
        its log (the cache's :attr:`log` keeps every step it took)."""
        super().reorder_cache(beam_idx)
        if self._sequence_logs:
            logs = self._sequence_logs
            self._sequence_logs = [logs[j] if first else logs[j].copy()
                                   for j, first in beam_sources(beam_idx)]

    @classmethod
    def batch_of(cls, caches: list[TieredCache]) -> TieredCache:
        """One cache decoding the sequences of ``caches`` (one sequence each, one method) as a
        batch: their stores, scratch caches and certificate logs are shared, not copied, so
        each cache's :meth:`telemetry` holds its own sequence's steps; sequences shorter than
        the longest count as left-padded (pass the matching ``attention_mask`` and
        ``position_ids`` to the model)."""
        first = caches[0]
        require(all(c.attention is first.attention and c.quantizer == first.quantizer
                    and len(c.layers) == len(first.layers) for c in caches), ConfigError,
                "a batch's caches must share one method (attention and quantizer); decode "
                "other methods in their own batches.")
        require(all(len(layer.stores) == 1 for c in caches for layer in c.layers), CertKVError,
                "batch_of joins caches of one sequence each, prefilled; prefill every prompt "
                "before joining them.")
        batch = cls(len(first.layers), first.attention, first.quantizer, first.spec)
        width = max(c.get_seq_length() for c in caches)
        for i, layer in enumerate(batch.layers):
            layer.adopt([c.layers[i] for c in caches], width)
        batch._sequence_logs = [c.log for c in caches]
        return batch

    def bytes(self) -> dict[str, int]:
        """Byte accounting summed over layers (Table 13 / 22), and the FP16 blocks the scratch
        caches hold (``scratch``: their pools on a device; on a CPU store, which reads Tier-2
        in place, what a device scratch of the same capacities would hold)."""
        stores = self.stores()
        held = {name: sum(getattr(s, f"{name}_bytes")() for s in stores)
                for name in ("tier1", "annotation", "tail", "device", "tier2", "dense",
                             "workspace")}
        held["scratch"] = sum(s.held_bytes(store.block_size, store.head_dim)
                              for layer in self.layers  # before a prefill: no store
                              for store, s in zip(layer.stores, layer.scratches, strict=False))
        return held

    def scratch_stats(self) -> ScratchStats:
        total = ScratchStats()
        for layer in self.layers:
            for scratch in layer.scratches:
                total = total + scratch.stats
        return total

    def telemetry(self) -> CacheTelemetry:
        """The log (its last step closed), bytes and scratch counters, detached from the
        stores: they outlive the cache."""
        self.log.flush()
        for log in self._sequence_logs + self._left_logs:
            log.flush()
        counts = [s.eviction_counts() for s in self.stores()]
        eviction = {name: sum(c[name] for c in counts) for name in counts[0]} if counts else {}
        return CacheTelemetry(self.log, self.bytes(), self.scratch_stats(), eviction)

