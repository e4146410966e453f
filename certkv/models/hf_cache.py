"""transformers integration: a ``Cache`` whose layers are :class:`TieredKVStore` objects.

``TieredCache.update`` appends the new post-RoPE keys/values to the layer's store and returns a
:class:`StoreHandle` instead of tensors; the registered ``certkv`` attention function
(``certkv.models.hook``) receives that handle as ``key`` and runs dense SDPA for prefill and
:class:`CertifiedAttention` for every single-token decode step. Works with ``model(...)`` loops
and ``model.generate(...)``. Batch size 1 (the paper's setting).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, DynamicLayer

from certkv.attention import CertifiedAttention
from certkv.cache import thresholds
from certkv.cache.scratch import ScratchCache, ScratchStats
from certkv.cache.store import TieredKVStore
from certkv.certify.certificate import CertificateLog
from certkv.errors import CertKVError, ConfigError, require
from certkv.quant.importance import ImportanceBoard
from certkv.quant.kv import KVQuantizer

_BATCH = ("{n} sequences at once are not supported (a batch of {n} prompts, or generate() with "
          "num_beams={n} or num_return_sequences={n}, which decode a batch): certkv follows the "
          "paper's batch size 1, so decode one sequence at a time with greedy or sampled "
          "generation (num_beams=1).")


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


@dataclass
class StoreHandle:
    """What ``update`` returns as keys and values: the layer plus the fresh states
    ``[1, Hkv, T, d]`` (full precision, used by prefill's dense SDPA)."""

    layer: TieredLayer
    new_keys: torch.Tensor
    new_values: torch.Tensor


class TieredLayer(DynamicLayer):
    """One decoder layer's cache: a :class:`TieredKVStore` plus its scratch cache.

    It refers to its :class:`TieredCache` weakly: a strong back-reference would make a cycle that
    keeps every dropped cache (stores, Tier-2, scratch) alive until Python's cyclic collector
    happens to run."""

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.store: TieredKVStore | None = None
        self.scratch = ScratchCache(cache.spec.scratch_key_blocks, cache.spec.scratch_value_blocks)
        self._inference = False  # the store was made or written under torch.inference_mode()

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        require(key_states.shape[0] == 1, CertKVError, _BATCH.format(n=key_states.shape[0]))
        self.dtype, self.device = key_states.dtype, key_states.device
        _, hkv, _, d = key_states.shape
        self.store = TieredKVStore(hkv, d, device=key_states.device,
                                   decoded_mirror=self.cache.attention.decoded_mirror(
                                       key_states.device),
                                   **self.cache.quantizer.store_kwargs())
        self.store.join(self.cache.board, self.layer_idx)
        self.store.defer_commit = self.cache.defer_commit
        if self.layer_idx in self.cache._loaded:
            self.store.boundaries = self.cache._loaded[self.layer_idx]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        require(key_states.shape[0] == 1, CertKVError, _BATCH.format(n=key_states.shape[0]))
        self._writable()
        capturing = self.cache.captured is not None
        append = self.store.append_in_place if capturing else self.store.append
        append(key_states[0], value_states[0])
        handle = StoreHandle(self, key_states, value_states)
        return handle, handle

    def _writable(self) -> None:
        """A store made or written under ``torch.inference_mode()`` holds inference tensors,
        which PyTorch lets nothing update in place outside that mode: the first update outside
        it after one inside (a prompt prefilled under ``inference_mode``, then ``generate()``,
        which runs under ``no_grad``) swaps in a copy made outside it
        (:meth:`TieredKVStore.clone`, once)."""
        inside = torch.is_inference_mode_enabled()
        if self._inference and not inside:
            self.store = self.store.clone()
            self.store.join(self.cache.board, self.layer_idx)
        self._inference = inside

    def record(self, cert) -> None:
        """Log this layer's decode-step certificate and let its store observe it; while a
        step is being captured (:class:`~certkv.graphs.GraphedDecode`), keep it in the
        cache's ``captured`` instead (each replay records its copy)."""
        cache = self.cache
        if cache.captured is not None:
            cache.captured.append((self.layer_idx, cert))
            return
        cache.log.record(self.layer_idx, cert)
        self.store.observe(cert)

    @property
    def cache(self) -> TieredCache:
        return self._cache()

    def get_seq_length(self) -> int:
        return 0 if self.store is None else self.store.num_tokens

    def _unsupported(self, *args, **kwargs):
        raise CertKVError("this cache operation (beam search, cropping, batching) is not "
                          "supported by TieredCache; use greedy decoding with batch size 1.")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = _unsupported


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
            if theirs.store is not None:
                mine.store = theirs.store.clone()
                mine.store.join(cache.board, mine.layer_idx)
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
            if layer.store is not None and layer.layer_idx in self._loaded:
                layer.store.boundaries = self._loaded[layer.layer_idx]

    def stores(self) -> list[TieredKVStore]:
        return [layer.store for layer in self.layers if layer.store is not None]

    def bytes(self) -> dict[str, int]:
        """Byte accounting summed over layers (Table 13 / 22)."""
        stores = self.stores()
        return {name: sum(getattr(s, f"{name}_bytes")() for s in stores)
                for name in ("tier1", "annotation", "tail", "device", "tier2", "dense",
                             "workspace")}

    def scratch_stats(self) -> ScratchStats:
        total = ScratchStats()
        for layer in self.layers:
            total = total + layer.scratch.stats
        return total

    def telemetry(self) -> CacheTelemetry:
        """The log (its last step closed), bytes and scratch counters, detached from the
        stores: they outlive the cache."""
        self.log.flush()
        counts = [s.eviction_counts() for s in self.stores()]
        eviction = {name: sum(c[name] for c in counts) for name in counts[0]} if counts else {}
        return CacheTelemetry(self.log, self.bytes(), self.scratch_stats(), eviction)
