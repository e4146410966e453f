"""transformers integration: a ``Cache`` whose layers are :class:`TieredKVStore` objects.

``TieredCache.update`` appends the new post-RoPE keys/values to the layer's store and returns a
:class:`StoreHandle` instead of tensors; the registered ``certkv`` attention function
(``certkv.models.hook``) receives that handle as ``key`` and runs dense SDPA for prefill and
:class:`CertifiedAttention` for every single-token decode step. Works with ``model(...)`` loops
and ``model.generate(...)``, for one sequence or a left-padded batch (one store per sequence
and layer, :meth:`~certkv.attention.CertifiedAttention.batch`; padding never enters a store),
sampled, greedy or by beam search (:meth:`TieredLayer.reorder_cache`).
"""

from __future__ import annotations

import os
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

_ONE_SEQUENCE = ("{what} holds one sequence's stores; this cache decodes a batch of {n}: use "
                 "layer.stores (one per sequence), or decode one sequence per cache.")


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


@dataclass
class StoreHandle:
    """What ``update`` returns as keys and values: the layer plus the fresh states
    ``[B, Hkv, T, d]`` (full precision, used by prefill's dense SDPA; with ``B > 1`` the
    attention function appends each sequence's unpadded states itself, it alone sees the
    mask)."""

    layer: TieredLayer
    new_keys: torch.Tensor
    new_values: torch.Tensor


class TieredLayer(DynamicLayer):
    """One decoder layer's cache: a :class:`TieredKVStore` and a scratch cache per sequence
    (one for a batch of one, as the paper decodes).

    It refers to its :class:`TieredCache` weakly: a strong back-reference would make a cycle that
    keeps every dropped cache (stores, Tier-2, scratch) alive until Python's cyclic collector
    happens to run."""

    def __init__(self, cache: TieredCache, layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.ref(cache)
        self.layer_idx = layer_idx
        self.stores: list[TieredKVStore] = []  # one per sequence of the batch
        self.sequences: list[int] = [0]  # each store's sequence: its place when it entered
        self.scratches = [self._new_scratch()]
        self.positions = 0  # positions the model has sent, padding included
        self.batched = False  # held a batch of sequences (positions count padding)
        self._inference = False  # the store was made or written under torch.inference_mode()

    @property
    def store(self) -> TieredKVStore | None:
        """The one sequence's store (None before the first update)."""
        require(len(self.stores) <= 1, CertKVError,
                _ONE_SEQUENCE.format(what="layer.store", n=len(self.stores)))
        return self.stores[0] if self.stores else None

    @store.setter
    def store(self, store: TieredKVStore | None) -> None:
        self.stores = [] if store is None else [store]

    @property
    def scratch(self) -> ScratchCache:
        """The one sequence's scratch cache."""
        require(len(self.scratches) == 1, CertKVError,
                _ONE_SEQUENCE.format(what="layer.scratch", n=len(self.scratches)))
        return self.scratches[0]

    def _new_scratch(self) -> ScratchCache:
        spec = self.cache.spec
        return ScratchCache(spec.scratch_key_blocks, spec.scratch_value_blocks)

    def _new_store(self, hkv: int, d: int, device: torch.device) -> TieredKVStore:
        cache = self.cache
        store = TieredKVStore(hkv, d, device=device,
                              decoded_mirror=cache.attention.decoded_mirror(device),
                              **cache.quantizer.store_kwargs())
        store.join(cache.board, self.layer_idx)
        store.defer_commit = cache.defer_commit
        if self.layer_idx in cache._loaded:
            store.boundaries = cache._loaded[self.layer_idx]
        return store

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        batch, hkv, tokens, d = key_states.shape
        if batch > 1 and self.layer_idx == 0:  # before any layer allocates
            self.cache.check_memory(batch, hkv * tokens * d, key_states.device)
        self.batched, self.sequences = batch > 1, list(range(batch))
        self.stores = [self._new_store(hkv, d, key_states.device) for _ in range(batch)]
        self.scratches = [self.scratches[0], *(self._new_scratch() for _ in range(batch - 1))]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        batch = key_states.shape[0]
        require(batch == len(self.stores), CertKVError,
                f"this cache holds {len(self.stores)} sequences but the model sent {batch}; "
                "start a new cache for a new batch.")
        self._writable()
        self.positions += key_states.shape[2]
        if batch == 1:  # one sequence: appended here (a batch's, by the attention, unpadded)
            self.append(0, key_states[0], value_states[0])
        handle = StoreHandle(self, key_states, value_states)
        return handle, handle

    def append(self, sequence: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v [Hkv, T, d]`` to sequence ``sequence``'s store: in place while a decode
        step is being captured (:meth:`TieredKVStore.append_in_place`, one token), else
        :meth:`TieredKVStore.append`."""
        store = self.stores[sequence]
        (store.append if self.cache.captured is None else store.append_in_place)(k, v)

    def _writable(self) -> None:
        """A store made or written under ``torch.inference_mode()`` holds inference tensors,
        which PyTorch lets nothing update in place outside that mode: the first update outside
        it after one inside (a prompt prefilled under ``inference_mode``, then ``generate()``,
        which runs under ``no_grad``) swaps in a copy made outside it
        (:meth:`TieredKVStore.clone`, once)."""
        inside = torch.is_inference_mode_enabled()
        if self._inference and not inside:
            self.stores = self._copies(self.stores)
        self._inference = inside

    def _copies(self, stores: list[TieredKVStore]) -> list[TieredKVStore]:
        """Independent copies of ``stores`` (:meth:`TieredKVStore.clone`) joined to this
        layer's place on its cache's importance board."""
        copies = [store.clone() for store in stores]
        for store in copies:
            store.join(self.cache.board, self.layer_idx)
        return copies

    def record(self, cert) -> None:
        """Log this layer's decode-step certificate and let its store observe it; while a
        step is being captured (:class:`~certkv.graphs.GraphedDecode`), keep it in the
        cache's ``captured`` instead (each replay records its copy)."""
        cache = self.cache
        if cache.captured is not None:
            cache.captured.append((self.layer_idx, cert))
            return
        if self.batched:  # a batch down to its last sequence: still that sequence's log
            self.record_batch([cert])
            return
        cache.log.record(self.layer_idx, cert)
        self.store.observe(cert)

    def record_batch(self, certs: list) -> None:
        """A batch step's certificates, one per sequence: each sequence's log and store get its
        own, the cache's log all of them (joined over the batch when the step closes); while a
        step is being captured, the cache's ``captured`` keeps them (as :meth:`record`)."""
        cache = self.cache
        if cache.captured is not None:
            cache.captured.append((self.layer_idx, list(certs)))
            return
        for cert, store, log, sequence in zip(certs, self.stores,
                                              cache.sequence_logs(len(certs)), self.sequences,
                                              strict=True):
            cert.sequence = sequence  # its place in the batch as it entered, not as it is now
            log.record(self.layer_idx, cert)
            store.observe(cert)
        cache.log.record(self.layer_idx, list(certs))

    @property
    def cache(self) -> TieredCache:
        return self._cache()

    def get_seq_length(self) -> int:
        """Positions the model has sent (a batch's padding included: what its masks and
        positions count); one sequence's store holds exactly these tokens."""
        if len(self.stores) == 1 and not self.batched:
            return self.stores[0].num_tokens
        return self.positions

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the sequences at ``indices`` (finished ones leave; no store is copied)."""
        keep = [int(i) for i in indices]
        self.stores = [self.stores[i] for i in keep]
        self.scratches = [self.scratches[i] for i in keep]
        self.sequences = [self.sequences[i] for i in keep]

    def adopt(self, layers: list[TieredLayer], positions: int) -> None:
        """Hold the sequences of ``layers`` (one cache's layer each, same index) as a batch,
        sharing their stores and scratch caches (nothing is copied); ``positions``: the
        batch's width, its longest sequence (the others are left-padded to it)."""
        self.stores = [s for layer in layers for s in layer.stores]
        self.scratches = [s for layer in layers for s in layer.scratches]
        self.sequences = list(range(len(self.stores)))
        self.positions, self.batched = positions, True
        self.dtype, self.device = layers[0].dtype, layers[0].device
        self.is_initialized = True
        self._inference = torch.is_inference_mode_enabled()

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each sequence ``repeats`` times in a row, as independent copies
        (:meth:`TieredKVStore.clone`)."""
        self.batched = self.batched or repeats > 1
        self.stores = [s if r == 0 else s.clone() for s in self.stores for r in range(repeats)]
        self.sequences = list(range(len(self.stores)))
        for store in self.stores:  # the originals too: every sequence starts its fault stream
            store.join(self.cache.board, self.layer_idx)
        self.scratches = [self._new_scratch() for _ in self.stores]

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: sequence ``i`` continues sequence ``beam_idx[i]``. A sequence one beam
        chooses moves there (nothing is copied); one several beams choose is copied for each
        but the first (:meth:`TieredKVStore.clone`: its blocks, tail, tiers, statistics and
        Tier-2 originals, every copy its own from then on, with a scratch cache of its own);
        one no beam chooses leaves the batch."""
        stores, scratches = [], []
        for j, first in _beams(beam_idx):
            if first:
                stores.append(self.stores[j])
                scratches.append(self.scratches[j])
                continue
            copy = self.stores[j].clone()
            copy.join(self.cache.board, self.layer_idx)
            stores.append(copy)
            scratches.append(self._new_scratch())
        self.stores, self.scratches = stores, scratches
        self.sequences = list(range(len(stores)))  # a beam's place is its sequence

    def crop(self, *args, **kwargs) -> None:
        raise CertKVError("cropping the cache (assisted or speculative decoding) is not "
                          "supported by TieredCache; decode without an assistant model.")


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
                                   for j, first in _beams(beam_idx)]

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


def _beams(beam_idx) -> list[tuple[int, bool]]:
    """``(j, first)`` per beam of a reorder: the sequence ``j`` it continues, and whether it is
    the first beam to continue ``j`` (which takes the sequence itself; later ones copy it)."""
    seen: set[int] = set()
    out = []
    for j in (int(i) for i in beam_idx):
        out.append((j, j not in seen))
        seen.add(j)
    return out
