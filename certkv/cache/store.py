"""TieredKVStore: one layer's tiered KV cache (paper 2.3, 3.1, Table 13).

* FP16 **tail**: the trailing partial block (fewer than ``B`` tokens), in device memory, exact.
* **Tier-1** (device): completed blocks, quantized atomically when they fill, with scales taken
  from those ``B`` tokens alone (precondition P1), each at the precision of its stage
  (:mod:`certkv.quant.kv`: exact windows, a quantized body, or seed 004's tiers, recorded per
  block in a :class:`~certkv.cache.blocks.BlockTable`); a block that changes precision is
  re-quantized from its Tier-2 originals together with its annotations. Plus six FP32 annotations
  per block and kv head (:data:`ANNOTATIONS`, 24 bytes), measured exactly in FP64 at write time
  from the FP16 originals and rounded up: ``eta_b`` (max per-token value reconstruction error),
  ``nu_b`` (max per-token value norm), the value-error spectral norm ``s_b``, the key error's
  max token norm and spectral norm (with the codec's decode slack, so they bound the keys any
  kernel decodes) and the centred value radius ``max_t ||v_t - c||``.
* **Tier-2** (host, pinned when the device is CUDA): the FP16 originals of every completed block,
  the ground truth for promotion and for the dense fallback (precondition P4).

Shapes: ``append`` takes ``k, v: [Hkv, T, d]``; block tensors are ``[Hkv, n_blocks, B, d]``.
"""

from __future__ import annotations

import copy
import importlib.util
from typing import ClassVar

import torch

from certkv.cache import fused
from certkv.cache.accounting import ByteAccounting
from certkv.cache.annotations import (
    ANNOTATIONS,
    HEALTH,
    block_annotations,
)
from certkv.cache.appending import Appending
from certkv.cache.blocks import BlockTable, GrowingBlocks
from certkv.cache.faults import FaultHandling
from certkv.cache.mirror import MIRROR_FILL, mirror_fields
from certkv.cache.originals import Tier2Reads
from certkv.cache.residency import Residency
from certkv.cache.stages import Stages
from certkv.cache.views import StoreViews
from certkv.errors import (
    ConfigError,
    require,
)
from certkv.quant import (
    Blocks,
    ChannelAffineKeyCodec,
    GroupAffineValueCodec,
    KeyCodec,
    LayerContext,
    ValueCodec,
)
from certkv.quant.int8_channel import is_int8
from certkv.quant.kv import KVQuantizer
from certkv.quant.protect.protection import Protection


class TieredKVStore(Appending, StoreViews, FaultHandling, Residency, Tier2Reads,
                    ByteAccounting):
    """One layer's KV cache: FP16 tail, Tier-1 quantized blocks, Tier-2 FP16 originals.

    Args:
        num_kv_heads: ``Hkv``.
        head_dim: ``d``.
        block_size: ``B`` tokens per block (paper default 16; default: the quantizer's, 16 without
            one; a quantizer made for another block size is refused).
        value_group: ``g`` channels per value group of the default value codec (paper 16).
        device: where the tail and Tier-1 live; Tier-2 is always host memory (a store with FP16
            passthrough codecs is lossless: its Tier-1 holds the originals, no Tier-2 copy).
        key_codec: default ``ChannelAffineKeyCodec(bits=8)``.
        value_codec: default ``GroupAffineValueCodec(bits=4, group=value_group)``.
        keep_originals: keep Tier-2; without it nothing can be promoted or fall back.
        decoded_mirror: also keep the FP32 reconstruction of every block, decoded once when the
            block is quantized (values block-major), the FP16 original keys in FP32, the
            per-channel key bounds and the slot bias, with the partial tail block kept in place
            by :meth:`append`. The PyTorch reference path then reads it instead of decoding
            Tier-1 or converting Tier-2 every step (a CPU speed aid: about 3x the FP16 cache;
            the values are bit-identical to decoding the codes; :meth:`workspace_bytes`).
            ``"lean"``: only what the CPU loops (the numba backend) read of it where every
            block's keys are the one INT8 codec's or exact (the loops decode INT8 codes in
            place and read FP16 originals from Tier-2 and the tail buffer): the values, key
            bounds and slot bias, about a third of the whole mirror (the whole one for other
            stores, :func:`mirror_fields`). Readers of what a lean mirror leaves out decode or
            convert it per step.
        fused_encode: quantize completed blocks with the Triton kernel
            (``certkv.kernels.triton_quantize``); ``None`` = on CUDA when the codecs are the
            defaults (INT8 keys, INT4 values) and B, d are powers of two.

    Attributes:
        defer_commit: keep a tail block that fills as the tail, full and exact, until the next
            token arrives (or :meth:`flush_tail`), and commit it then; off by default (a block
            is committed as it fills). A whole decode step captured in a graph
            (:class:`~certkv.graphs.GraphedDecode`) appends its token in place, which cannot
            quantize a block, so it sets this and commits between steps: a step then attends
            to a tail of 1 to ``B`` exact tokens instead of 0 to ``B - 1``.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        block_size: int | None = None,
        value_group: int = 16,
        device: str | torch.device = "cpu",
        key_codec: KeyCodec | None = None,
        value_codec: ValueCodec | None = None,
        keep_originals: bool = True,
        decoded_mirror: bool | str = False,
        fused_encode: bool | None = None,
        quantizer: KVQuantizer | None = None,
    ) -> None:
        if block_size is None:  # the quantizer's (16 without one)
            block_size = 16 if quantizer is None else quantizer.block_size
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                            ("block_size", block_size)):
            require(isinstance(value, int) and value >= 1, ConfigError,
                    f"{name}={value!r} must be a positive integer.")
        require(quantizer is None or (key_codec is None and value_codec is None), ConfigError,
                "pass either a quantizer or key_codec / value_codec, not both.")
        require(quantizer is None or quantizer.block_size == block_size, ConfigError,
                f"block_size={block_size} differs from the quantizer's block_size="
                f"{getattr(quantizer, 'block_size', None)}; pass **quantizer.store_kwargs() (or "
                "the quantizer's block_size).")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = torch.empty(0, device=device).device  # "cuda" -> cuda:0, as tensors say
        self.quantizer = quantizer or KVQuantizer(
            key_codec or ChannelAffineKeyCodec(),
            value_codec or GroupAffineValueCodec(group=value_group), block_size)
        self.key_codec = self.quantizer.key_codec  # the main (e.g. warm) precision's codecs
        self.value_codec = self.quantizer.value_codec
        self.protection = self.quantizer.protection or Protection()
        self.precisions = [self.protection.wrap(p) for p in self.quantizer.precisions()]
        eviction = getattr(self.quantizer, "eviction", None)
        self.evicted_pid: int | None = None  # the summary precision of evicted blocks (last)
        if eviction is not None and eviction.enabled:
            self.precisions.append(self.protection.wrap(eviction.summary_precision()))
            self.evicted_pid = len(self.precisions) - 1
        for pid, precision in enumerate(self.precisions):
            if pid == self.evicted_pid or self.quantizer.may_hold(pid):
                precision.validate(head_dim, block_size)
        self.keep_originals = keep_originals
        self.stages = Stages(self.quantizer.stage_ages(), block_size, self.quantizer.sink)
        self._tracker = self._new_tracker()
        self._evictor = None if self.evicted_pid is None else eviction.tracker(self)
        self._block_bytes: dict[int, int] = {}
        self._faults = self.protection.faults
        self._fault_rng = self._faults.generator(0)
        self.bits_flipped = 0  # by the fault injector, over every write (or read) of this store
        self._step_read: Blocks | None = None  # transient faults without a mirror: this read
        self._step_codes: dict[tuple[int, str], Blocks] = {}  # transient: words this step read
        self.fused_encode = not self.protection.enabled and self._fused_supported() and (
            self.device.type == "cuda" if fused_encode is None else fused_encode)

        # FP16 passthrough codecs (dense mode, dense prefill): Tier-1 already holds the
        # originals on the device, so there is no Tier-2 copy and dense reads need no H2D copy
        self.lossless = all(p.exact for p in self.precisions)
        pin = self.device.type == "cuda"
        spare = 1 if self.lossless else 0  # room for the tail block: zero-copy dense views
        self._table = BlockTable(self.precisions, self.device,
                                 (num_kv_heads, block_size, head_dim), spare=spare)
        # ANNOTATIONS: [Hkv, n] each, and a zero column after them (the exact tail block)
        self._annotations = GrowingBlocks(self.device, spare=1,
                                          fill=dict.fromkeys(ANNOTATIONS, 0.0))
        self._health = GrowingBlocks(self.device) if self.protection.enabled else None  # HEALTH
        self._tier2 = GrowingBlocks(torch.device("cpu"), pin=pin)  # k, v: [Hkv, n, B, d] fp16
        # the decoded mirror (k, v, bound), the original keys in FP32 (orig_k) and the slot
        # bias (0 on a token, -inf on an empty slot), with the partial tail block kept in the
        # spare row by append()
        self._mirror_fields = mirror_fields(decoded_mirror, self.precisions,
                                            self.protection.enabled, keep_originals)
        self._mirror = GrowingBlocks(self.device, spare=1, fill={
            name: MIRROR_FILL[name] for name in self._mirror_fields}
        ) if self._mirror_fields else None
        tail_shape = (num_kv_heads, block_size, head_dim)
        self._tail_k = torch.zeros(tail_shape, dtype=torch.float16, device=self.device)
        self._tail_v = torch.zeros(tail_shape, dtype=torch.float16, device=self.device)
        self._counts = torch.zeros(2, dtype=torch.int32, device=self.device)  # blocks, tail
        self._count_views()
        self.tail_len = 0
        # running maxima of the blocks' nu_b and v_radius_b ([2, Hkv]), of eta_b ([Hkv])
        self._block_maxima = torch.zeros(2, num_kv_heads, device=self.device)
        self._eta_max = torch.zeros(num_kv_heads, device=self.device)
        # the same over the partial tail block's tokens (rounded up; 0 when it is empty), and
        # of every token: V_max and the centred radius (value_norm_max, value_radius)
        self._tail_maxima = torch.zeros(2, num_kv_heads, device=self.device)
        self._value_maxima = torch.zeros(2, num_kv_heads, device=self.device)
        # the fixed centre c of the centred value radius: per-channel midrange of the values
        # of the first append (any fixed c is valid, Theorem 4.3 centred)
        self._centre = torch.zeros(num_kv_heads, head_dim, device=self.device)
        self._centred = False
        # running channel max of |k| over every token: the logit magnitude of e_arith
        self._key_abs_max = torch.zeros(num_kv_heads, head_dim, device=self.device)
        # what codecs may read about the layer (InnerQ): the prefill's key maxima, and whether
        # blocks are being quantized during the first append
        self._layer = LayerContext()
        self._nonfinite = torch.zeros((), dtype=torch.bool, device=self.device)
        self._views = None  # the fused append's NumPy views (_append_views)
        self._rows = None  # original_rows' views, with the originals' views they were made of
        self.defer_commit = False
        self._allocate()

    def _allocate(self) -> None:
        """Allocate the buffers of the precision new blocks start at (and every annotation), so
        views exist while the store is empty."""
        empty = torch.zeros(self.num_kv_heads, 0, self.block_size, self.head_dim,
                            dtype=torch.float16, device=self.device)
        pid = self.quantizer.stage_precision(0, 0)
        none = torch.zeros(0, dtype=torch.long)
        keys, values, notes = self._encode(empty, empty, pid, none)
        self._table.allocate(pid, keys, values)
        self._keep_notes(notes)
        if self._mirror is not None:
            self._mirror.extend(self._mirror_rows(self._decoded(none, bias=True), empty))

    def _fused_supported(self) -> bool:
        q = self.quantizer
        pow2 = all(x & (x - 1) == 0 for x in (self.block_size, self.head_dim))
        single = not q.stage_ages() and not q.sink and len(q.precisions()) == 2  # exact + main
        values = self.value_codec.kernel_layout(self.head_dim)  # the kernel writes 4-bit groups
        return (pow2 and single and is_int8(self.key_codec) and values is not None
                and not values.fp16 and values.bits == 4 and fused.block_encoder() is not None
                and importlib.util.find_spec("triton") is not None)

    def _encode(self, k16: torch.Tensor, v16: torch.Tensor, pid: int, start: torch.Tensor):
        """Codes, metadata and :data:`ANNOTATIONS` of blocks ``[Hkv, n, B, d]`` (first token
        positions ``start [n]``) at precision ``pid``. The annotations are measured in PyTorch
        on either path (the fused kernel's own eta / nu are not used)."""
        precision = self.precisions[pid]
        key_codec, value_codec = precision.key_codec, precision.value_codec
        main = key_codec is self.key_codec and value_codec is self.value_codec
        if self.fused_encode and main and k16.shape[1]:  # the kernel encodes the main codecs
            key_blocks, value_blocks, _, _ = fused.block_encoder()(k16, v16, value_codec.group)
        else:
            key_blocks = key_codec.encode_at(k16, start, self._layer)
            value_blocks = value_codec.encode_at(v16, self._layer)
        notes = block_annotations(k16, v16, key_codec, value_codec, key_blocks, value_blocks,
                                  self._centre)
        if self._health is not None:
            if not precision.exact:
                key_blocks, value_blocks = self._inject(key_blocks, value_blocks)
            notes.update(self._read_health(precision, key_blocks, value_blocks, notes))
        return key_blocks, value_blocks, notes

    def _keep_notes(self, notes: dict[str, torch.Tensor], blocks: torch.Tensor | None = None,
                    ) -> None:
        """Store new blocks' annotations (and :data:`HEALTH`), appended or at ``blocks``."""
        parts = [(self._annotations, {k: notes[k] for k in ANNOTATIONS})]
        if self._health is not None:
            parts.append((self._health, {k: notes[k] for k in HEALTH}))
        for storage, part in parts:
            if blocks is None:
                storage.extend(part)
            else:
                storage.put(blocks, part)

    def _merged_notes(self, parts: list, n: int) -> dict[str, torch.Tensor]:
        """The annotations ``[Hkv, n]`` of ``n`` new blocks from ``parts``: ``(positions
        (device), notes)`` per precision they were quantized at."""
        notes = {name: torch.empty(self.num_kv_heads, n, dtype=t.dtype, device=self.device)
                 for name, t in parts[0][1].items()}
        for dev, note in parts:
            for name, t in note.items():
                notes[name][:, dev] = t
        return notes

    def _starts(self, blocks: torch.Tensor) -> torch.Tensor:
        """First token position ``[m]`` of each block (block ``b`` starts at ``b B``)."""
        return blocks * self.block_size

    def _commit_blocks(self, k16: torch.Tensor, v16: torch.Tensor, seq_len: int) -> None:
        """Quantize completed blocks ``[Hkv, n, B, d]`` (the newest; the sequence then holds
        ``seq_len`` tokens), each at the precision of the stage its age has reached, and move
        their originals to Tier-2."""
        n = k16.shape[1]
        first = self.num_blocks
        stages = self.stages.add(n, seq_len)
        pids = torch.tensor([self.quantizer.stage_precision(int(st), seq_len) for st in stages],
                            dtype=torch.long)
        keys, values, parts = [], [], []
        for pid in pids.unique().tolist():
            where = (pids == pid).nonzero(as_tuple=True)[0]
            dev = where.to(self.device)
            k, v, note = self._encode(k16[:, dev], v16[:, dev], pid, self._starts(first + where))
            keys.append(k)
            values.append(v)
            parts.append((dev, note))
        self._table.add(pids, keys, values)
        self._completed_count.fill_(self.num_blocks)
        notes = parts[0][1] if len(parts) == 1 else self._merged_notes(parts, n)
        self._keep_notes(notes)
        self._note_maxima(notes)
        if self.keep_originals and not self.lossless:
            self._tier2.extend({"k": k16, "v": v16})
        if self._mirror is not None:
            self._mirror.extend(self._mirror_rows(
                self._decoded(torch.arange(first, first + n), bias=True), k16))
        # every buffer a step reads in place grows with the annotations (one bucket of block
        # counts per doubling for a step captured in a graph: graph_signature)
        capacity = self.block_capacity()
        self._table.reserve(capacity)
        self._tier2.reserve(capacity)
        if self._mirror is not None:
            self._mirror.reserve(capacity)

    def _note_maxima(self, notes: dict[str, torch.Tensor]) -> None:
        """Fold new annotations into the running maxima (``[Hkv]`` each)."""
        if next(iter(notes.values())).shape[1]:
            new = torch.stack([notes["nu"].amax(dim=1), notes["v_radius"].amax(dim=1)])
            torch.maximum(self._block_maxima, new, out=self._block_maxima)
            torch.maximum(self._eta_max, notes["eta"].amax(dim=1), out=self._eta_max)
            torch.maximum(self._block_maxima, self._tail_maxima, out=self._value_maxima)

    def _mirror_rows(self, rows: Blocks, originals: torch.Tensor | None = None) -> Blocks:
        """Decoded rows in the mirror's layout, the fields it keeps: values block-major ``[1,
        m, Hkv, B, d]`` (the reference's per-block value products read every (block, kv head)
        as one batch), the rest as decoded (``[Hkv, m, ...]``), and the new blocks' FP16
        ``originals [Hkv, m, B, d]`` in FP32 where given."""
        rows = dict(rows)
        if "v" in rows:
            rows["v"] = rows["v"].transpose(0, 1).unsqueeze(0)
        if originals is not None:
            rows["orig_k"] = originals.float()
        return {name: x for name, x in rows.items() if name in self._mirror_fields}

    def _decoded(self, blocks: torch.Tensor, bias: bool = False) -> Blocks:
        """The decoded mirror's rows of ``blocks [m]`` (host): ``k, v [Hkv, m, B, d]`` (each
        only where the mirror keeps it) and ``bound [Hkv, m, d]``; with ``bias`` also the
        slot bias ``[1, m, B]`` (0: completed blocks have every slot)."""
        rows = {"bound": self._table.channel_bound(blocks)}
        for name, which in (("k", "key"), ("v", "value")):
            if name in self._mirror_fields:
                rows[name] = self._table.decode(which, blocks)
        rows = self._serve_corrupted(rows, blocks)
        if bias:
            rows["bias"] = torch.zeros(1, len(blocks), self.block_size, device=self.device)
        return rows

    # per-step caches a clone starts afresh (their initial values)
    _PER_STEP: ClassVar[dict] = {"_step_read": None, "_step_codes": dict, "_views": None,
                                 "_rows": None}

    def clone(self) -> TieredKVStore:
        """An independent copy of this store (every tier, annotation and running statistic), so
        one quantized prefill can serve several methods without quantizing it again. Derived
        from the fields, so a field added later is copied too: tensors and helper objects
        that ``clone()`` are cloned, trackers re-bound to the copy (``clone_for``), generators
        copied with their state, dicts copied; settings and components are shared."""
        new = copy.copy(self)
        for name, value in vars(self).items():
            setattr(new, name, self._cloned(name, value, new))
        new._count_views()  # views of the cloned counts, not of the original's
        return new

    def _cloned(self, name: str, value, new: TieredKVStore):
        """One field of :meth:`clone`'s copy ``new``."""
        if name in self._PER_STEP:
            fresh = self._PER_STEP[name]
            return fresh() if callable(fresh) else fresh
        if name == "_tracker" and not hasattr(value, "clone_for"):
            return new._new_tracker()  # a tracker that cannot follow a copy starts anew
        if hasattr(value, "clone_for"):
            return value.clone_for(new)
        if isinstance(value, torch.Generator):
            copied = torch.Generator(device=value.device)
            copied.set_state(value.get_state())
            return copied
        if isinstance(value, dict):
            return dict(value)
        return value.clone() if isinstance(value, torch.Tensor) or hasattr(value, "clone") \
            else value

    def drop_originals(self) -> None:
        """Release Tier-2 (e.g. host memory is exhausted); promotion and fallback then raise."""
        require(self._mirror is None or "k" in self._mirror_fields, ConfigError,
                "this store's lean decoded mirror reads exact windows' keys from Tier-2; build "
                "it with decoded_mirror=True to drop the originals.")
        self.keep_originals = False
        self._tier2.clear()

    def __repr__(self) -> str:
        held = ", ".join(f"{p.name}={p.label}" for p in self.precisions)
        return (f"TieredKVStore(Hkv={self.num_kv_heads}, d={self.head_dim}, B={self.block_size}, "
                f"tokens={self.num_tokens}, {held})")
