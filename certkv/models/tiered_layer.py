"""One decoder layer of :class:`~certkv.models.hf_cache.TieredCache`: a
:class:`TieredKVStore` and a scratch cache per sequence of the batch, how a prefill or decode
step's states reach them (:class:`StoreHandle`), and how a batch's sequences leave, repeat or
follow their beams."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from transformers.cache_utils import DynamicLayer

from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.errors import CertKVError, require

_ONE_SEQUENCE = ("{what} holds one sequence's stores; this cache decodes a batch of {n}: use "
                 "layer.stores (one per sequence), or decode one sequence per cache.")


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

    def __init__(self, cache, layer_idx: int) -> None:  # cache: its TieredCache
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
    def cache(self):
        """The :class:`~certkv.models.hf_cache.TieredCache` holding this layer (typed loosely:
        that module imports this one)."""
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
        for j, first in beam_sources(beam_idx):
            if first:
                stores.append(self.stores[j])
                scratches.append(self.scratches[j])
                continue
            stores += self._copies([self.stores[j]])
            scratches.append(self._new_scratch())
        self.stores, self.scratches = stores, scratches
        self.sequences = list(range(len(stores)))  # a beam's place is its sequence

    def crop(self, *args, **kwargs) -> None:
        raise CertKVError("cropping the cache (assisted or speculative decoding) is not "
                          "supported by TieredCache; decode without an assistant model.")


def beam_sources(beam_idx) -> list[tuple[int, bool]]:
    """``(j, first)`` per beam of a reorder: the sequence ``j`` it continues, and whether it is
    the first beam to continue ``j`` (which takes the sequence itself; later ones copy it)."""
    seen: set[int] = set()
    out = []
    for j in (int(i) for i in beam_idx):
        out.append((j, j not in seen))
        seen.add(j)
    return out
