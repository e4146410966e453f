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

import numpy as np
import torch

from certkv.cache import append_cpu, fused, room
from certkv.cache.accounting import ByteAccounting
from certkv.cache.annotations import (
    ANNOTATIONS,
    ERROR_NOTES,
    HEALTH,
    INFLATE,
    block_annotations,
)
from certkv.cache.blocks import BlockTable, GrowingBlocks
from certkv.cache.faults import FaultHandling
from certkv.cache.mirror import MIRROR_FILL, mirror_fields
from certkv.cache.originals import TIER2_MISSING, Tier2Reads
from certkv.cache.residency import Residency
from certkv.cache.stages import Stages
from certkv.certify.bounds import centred_radius
from certkv.errors import (
    ConfigError,
    NonFiniteError,
    ShapeError,
    Tier2UnavailableError,
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
from certkv.quant.base import round_up_fp32
from certkv.quant.int8_channel import is_int8
from certkv.quant.kv import KVQuantizer
from certkv.quant.precision import Precision
from certkv.quant.protect.protection import Protection
from certkv.quant.summary import evicted_precision

NONFINITE_KV = ("k or v holds NaN or Inf (or values beyond the FP16 range); fix the model outputs "
                "before caching them.")


class TieredKVStore(FaultHandling, Residency, Tier2Reads, ByteAccounting):
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
            self.precisions.append(self.protection.wrap(evicted_precision()))
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

    # ------------------------------------------------------------------ writing
    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v: [Hkv, T, d]`` (post-RoPE, any float dtype, ``T >= 1``).

        Tokens join the FP16 tail; every block that fills is quantized at once (Tier-1) at the
        precision of its stage (with :attr:`defer_commit`, when the next token arrives), its
        annotations are measured and its FP16 originals move to Tier-2. Blocks whose age
        reached a later stage are then re-quantized from Tier-2, and under a budget the oldest
        graduate early (:meth:`_graduate`).

        An append that raises changes nothing: shapes, non-finite K/V (on CPU), keys a
        precision cannot encode and a budget no arrangement of the blocks meets
        (:mod:`certkv.cache.room`) are checked first.
        """
        self._check_shapes(k, v)
        self._check_mode()
        if self._append_token(k, v):
            return
        k16, v16 = self._check_append(k, v)
        self._check_encodable(k16, (self.tail_len + k16.shape[1]) // self.block_size)
        # blocks the tokens complete; with defer_commit the last one stays the tail, full
        n_full = (self.tail_len + k16.shape[1] - int(self.defer_commit)) // self.block_size
        prefill = self._layer.key_max is None
        room.check_room(self, n_full, self.num_tokens + k16.shape[1], prefill)
        if not self._centred:
            vf = v16.float()
            self._centre = (vf.amax(dim=1) + vf.amin(dim=1)) / 2
            self._centred = True
        torch.maximum(self._key_abs_max, k16.abs().amax(dim=1).float(), out=self._key_abs_max)
        if prefill:
            self._layer = LayerContext(self._key_abs_max.clone(), prefill=True)
        self._add(k16, v16, n_full, prefill)
        if prefill:
            self._layer = self._layer._replace(prefill=False)

    def flush_tail(self) -> None:
        """Commit a full tail block now (``defer_commit`` keeps one until the next token), as
        the next :meth:`append` would; nothing otherwise."""
        if self.tail_len == self.block_size:
            self._check_mode()
            none = self._tail_k[:, :0]
            room.check_room(self, 1, self.num_tokens, prefill=False)
            self._add(none, none, 1, prefill=False)

    def _check_encodable(self, k16: torch.Tensor, n_full: int) -> None:
        """Before an append changes anything: the ``n_full`` blocks that the tail's keys and
        ``k16 [Hkv, T, d]`` fill (a full tail kept by ``defer_commit`` included) can be encoded
        at every precision they may be held at (a pre-RoPE archive refuses keys outside FP16's
        range once unrotated), so that no later graduation refuses them after their tokens
        were kept."""
        if not n_full:
            return
        cut = n_full * self.block_size
        keys = torch.cat([self._tail_k[:, : self.tail_len], k16], dim=1)[:, :cut]
        blocks = keys.reshape(self.num_kv_heads, n_full, self.block_size, self.head_dim)
        start = (self.num_tokens - self.tail_len
                 + self.block_size * torch.arange(n_full, device=self.device))
        for pid, precision in enumerate(self.precisions):
            if pid != self.evicted_pid and self.quantizer.may_hold(pid):
                precision.key_codec.check_encodable(blocks, start)

    def _add(self, k16: torch.Tensor, v16: torch.Tensor, n_full: int, prefill: bool) -> None:
        """Append checked FP16 tokens ``k16, v16 [Hkv, T, d]`` that complete ``n_full`` blocks
        (the tail's tokens first), then what follows a commit: later stages, the budget, the
        precision tracker and eviction."""
        self._step_read, self._step_codes = None, {}
        if n_full:
            self._commit_tail(k16, v16, n_full)
        else:  # the tokens join the tail block in place (a decode step: one token)
            start, self.tail_len = self.tail_len, self.tail_len + k16.shape[1]
            self._tail_k[:, start : self.tail_len] = k16
            self._tail_v[:, start : self.tail_len] = v16
            self._tail_changed(start, restarted=False)
        if self.stages.last or self.quantizer.budget_bytes is not None:
            self._graduate()
        if n_full and hasattr(self._tracker, "appended"):
            self._tracker.appended(prefill)
        if n_full and self._evictor is not None:
            self._evictor.appended(prefill)

    def _append_token(self, k: torch.Tensor, v: torch.Tensor) -> bool:
        """A decode step's one token on a CPU store as one numba call
        (:mod:`certkv.cache.append_cpu`: the same tail, maxima and mirror row as the path
        below); False, doing nothing, where it does not apply (:func:`append_cpu.covers`, the
        first append)."""
        if not (self._centred and self._layer.key_max is not None
                and append_cpu.covers(k, self.device, self.tail_len, self.block_size)):
            return False
        k16, v16 = (x.to(device=self.device, dtype=torch.float16) for x in (k, v))
        tails, mirror_rows = self._append_views()
        finite = append_cpu.append(  # the maxima updated in place (NumPy views of them)
            k16.view(torch.int16).numpy(), v16.view(torch.int16).numpy(), *tails,
            self.tail_len, *(x.numpy() for x in (self._centre, self._key_abs_max,
                                                 self._block_maxima, self._tail_maxima,
                                                 self._value_maxima)),
            INFLATE, self._mirror is not None, *mirror_rows,
            np.empty((2, 1, self.head_dim), np.float32))
        require(finite, NonFiniteError, NONFINITE_KV)
        self._step_read, self._step_codes = None, {}
        self.tail_len += 1
        if self.stages.last or self.quantizer.budget_bytes is not None:
            self._graduate()
        return True

    def _append_views(self) -> tuple[tuple, tuple]:
        """The NumPy views :meth:`_append_token` writes through: the tail buffers' bits and the
        decoded mirror's tail row (keys, original keys, values, slot bias; placeholders without
        a mirror), made again only when those buffers are not the ones they view."""
        spare = self._mirror.spare_view() if self._mirror is not None else None
        cached = self._views
        if cached is not None and cached[0] is spare and cached[1] is self._tail_k:
            return cached[2]
        unused = torch.zeros(self.num_kv_heads, self.block_size, self.head_dim)  # written only
        rows = ((*(spare[name][:, 0] if name in spare else unused for name in ("k", "orig_k")),
                 spare["v"][0, 0], spare["bias"][:, 0])
                if spare is not None else (torch.zeros(1, 1, 1),) * 3 + (torch.zeros(1, 1),))
        views = (tuple(x.view(torch.int16).numpy() for x in (self._tail_k, self._tail_v)),
                 tuple(x.numpy() for x in rows))
        self._views = (spare, self._tail_k, views)
        return views

    def _commit_tail(self, k16: torch.Tensor, v16: torch.Tensor, n_full: int) -> None:
        """Append ``k16, v16 [Hkv, T, d]`` that complete ``n_full`` blocks: those are committed
        (:meth:`_commit_blocks`), the rest starts a new tail block."""
        pending_k = torch.cat([self._tail_k[:, : self.tail_len], k16], dim=1)
        pending_v = torch.cat([self._tail_v[:, : self.tail_len], v16], dim=1)
        cut = n_full * self.block_size
        shape = (self.num_kv_heads, n_full, self.block_size, self.head_dim)
        self._commit_blocks(pending_k[:, :cut].reshape(shape), pending_v[:, :cut].reshape(shape),
                            self.num_tokens + k16.shape[1])
        self.tail_len = pending_k.shape[1] - cut
        self._tail_k[:, : self.tail_len] = pending_k[:, cut:]
        self._tail_v[:, : self.tail_len] = pending_v[:, cut:]
        self._tail_changed(0, restarted=True)

    def _tail_changed(self, start: int, restarted: bool) -> None:
        """Fold tail rows ``start:tail_len`` into the tail's value maxima and the mirror's tail
        row (after a block completed, the tail restarted: ``start`` is 0 and the old maxima
        go), so that a step reads both as they are."""
        rows = slice(start, self.tail_len)
        new_v = self._tail_v[:, rows]
        maxima = self._token_maxima(new_v)
        if restarted:
            self._tail_maxima.copy_(maxima)
        else:
            torch.maximum(self._tail_maxima, maxima, out=self._tail_maxima)
        torch.maximum(self._block_maxima, self._tail_maxima, out=self._value_maxima)
        if self._mirror is not None and self.tail_len > start:
            spare = self._mirror.spare_view()
            for name in ("k", "orig_k"):
                if name in spare:
                    spare[name][:, 0, rows] = self._tail_k[:, rows]
            spare["v"][0, 0, :, rows] = new_v
            spare["bias"][:, 0, rows] = 0.0

    def append_in_place(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append one decode token ``k, v: [Hkv, 1, d]`` that commits no block (the tail has
        room for it, and it does not complete the tail block unless ``defer_commit`` keeps a
        full one), writing every buffer in place at positions read from device memory (the tail
        block's fill and the completed-block count, :meth:`block_counts`): a model's decode
        step captured in a graph appends each replay's token where it belongs
        (:mod:`certkv.graphs`, :class:`~certkv.graphs.GraphedDecode`). The store ends as
        :meth:`append` leaves it, except that non-finite K/V is flagged for the attention step
        (:meth:`nonfinite_appended`) rather than raised, on every device. The host half, the
        tail's token count, is :meth:`advance_tail` (which a replay calls alone)."""
        self._check_shapes(k, v)
        room = self.tail_len + 1 < self.block_size + int(self.defer_commit)
        require(k.shape[1:] == (1, self.head_dim) and v.shape == k.shape
                and self._centred and room, ShapeError,
                "append_in_place takes one token [num_kv_heads, 1, head_dim] that commits no "
                "block, after the prompt; use append() for the others (or flush_tail() first).")
        self._check_mode()
        k16, v16 = (x.to(device=self.device, dtype=torch.float16) for x in (k, v))
        self._nonfinite |= ~(torch.isfinite(k16).all() & torch.isfinite(v16).all())
        torch.maximum(self._key_abs_max, k16.abs().amax(dim=1).float(), out=self._key_abs_max)
        slot = self._tail_count.long()
        self._tail_k.index_copy_(1, slot, k16)
        self._tail_v.index_copy_(1, slot, v16)
        torch.maximum(self._tail_maxima, self._token_maxima(v16), out=self._tail_maxima)
        torch.maximum(self._block_maxima, self._tail_maxima, out=self._value_maxima)
        if self._mirror is not None:  # the tail's row: after the completed blocks
            rows = self._mirror.buffers()
            at = (self._completed_count.long(), slot)
            for name in ("k", "orig_k"):
                if name in rows:
                    rows[name][(slice(None), *at)] = k16.to(rows[name].dtype)
            rows["v"][0].transpose(0, 1)[(slice(None), *at)] = v16.to(rows["v"].dtype)
            rows["bias"][(slice(None), *at)] = 0.0
        self._tail_count.add_(1)
        self.advance_tail()

    def advance_tail(self) -> None:
        """Count one token more in the tail block on the host (:meth:`append_in_place` counted
        it on the device)."""
        self._tail_len += 1
        self._step_read, self._step_codes = None, {}

    def _token_maxima(self, new_v: torch.Tensor) -> torch.Tensor:
        """``[2, Hkv]``: the largest norm and centred radius of the tail tokens ``new_v [Hkv,
        t, d]`` (FP64, rounded up together; 0 where ``t`` is 0)."""
        if not new_v.shape[1]:
            return torch.zeros(2, self.num_kv_heads, device=self.device)
        v64 = new_v.double()
        return round_up_fp32(torch.stack([
            v64.norm(dim=-1).amax(dim=-1), centred_radius(v64, self._centre) * INFLATE]))

    def _check_append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 copies of ``k, v`` (their shapes checked by :meth:`_check_shapes`), finite ones:
        NaN or Inf raises on CPU and is flagged for the next attention step's host read
        elsewhere."""
        k16 = k.to(device=self.device, dtype=torch.float16)
        v16 = v.to(device=self.device, dtype=torch.float16)
        bad = ~(torch.isfinite(k16).all() & torch.isfinite(v16).all())
        if self.device.type == "cpu":
            require(not bool(bad), NonFiniteError, NONFINITE_KV)
        else:  # no device sync per token: CertifiedAttention reads the flag with its others
            self._nonfinite |= bad  # in place: a captured step reads this tensor
        return k16, v16

    def _check_shapes(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self._shapes_fit(k) and self._shapes_fit(v) and k.shape[1] == v.shape[1]:
            return  # the messages below are built only for a bad append
        expected = f"[num_kv_heads={self.num_kv_heads}, T, head_dim={self.head_dim}]"
        for name, x in (("k", k), ("v", v)):
            require(isinstance(x, torch.Tensor) and x.dim() == 3, ShapeError,
                    f"{name} must be a 3-D tensor shaped {expected}; reshape it before append.")
            require(x.shape[0] == self.num_kv_heads and x.shape[2] == self.head_dim, ShapeError,
                    f"{name} has shape {tuple(x.shape)} but the store expects {expected}.")
            require(x.is_floating_point(), ShapeError,
                    f"{name} has dtype {x.dtype}; pass floating-point keys and values.")
        require(k.shape[1] == v.shape[1] and k.shape[1] >= 1, ShapeError,
                f"k and v must hold the same number T >= 1 of tokens (got {k.shape[1]} and "
                f"{v.shape[1]}).")

    def _check_mode(self) -> None:
        """A store made under ``torch.inference_mode()`` holds inference tensors, which PyTorch
        lets nothing update in place outside that mode: one sentence naming the fix instead of
        PyTorch's error deep inside an append (or, on the CPU's fused path, a tail written
        through NumPy that a later commit could not follow)."""
        require(torch.is_inference_mode_enabled() or not self._tail_k.is_inference(),
                ConfigError, "this store was made under torch.inference_mode(); append to it "
                "inside inference_mode too, or continue on store.clone() made outside it "
                "(certkv's transformers cache does that itself).")

    def _shapes_fit(self, x) -> bool:
        return (isinstance(x, torch.Tensor) and x.dim() == 3 and x.shape[1] >= 1
                and x.shape[0] == self.num_kv_heads and x.shape[2] == self.head_dim
                and x.is_floating_point())

    def nonfinite_appended(self) -> torch.Tensor:
        """0-d bool: some appended K/V was NaN/Inf (checked at once on CPU, deferred to the
        attention step's host read on accelerators)."""
        return self._nonfinite

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
        """The decoded mirror's rows of ``blocks [m]`` (host): ``k, v [Hkv, m, B, d]`` (keys
        only where the mirror keeps them) and ``bound [Hkv, m, d]``; with ``bias`` also the
        slot bias ``[1, m, B]`` (0: completed blocks have every slot)."""
        rows = {"v": self._table.decode("value", blocks),
                "bound": self._table.channel_bound(blocks)}
        if "k" in self._mirror_fields:
            rows["k"] = self._table.decode("key", blocks)
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

    # ------------------------------------------------------------------ reading
    @property
    def num_blocks(self) -> int:
        """Completed blocks (Tier-1: quantized or exact windows)."""
        return self._table.num_blocks

    @property
    def tail_len(self) -> int:
        """Tokens in the partial tail block (host); :meth:`block_counts` holds it on the
        device."""
        return self._tail_len

    @tail_len.setter
    def tail_len(self, value: int) -> None:
        self._tail_len = value
        self._tail_count.fill_(value)

    def _count_views(self) -> None:
        """Views of ``_counts`` the kernels read (made once: no operator per step)."""
        self._completed_count, self._tail_count = self._counts[:1], self._counts[1:]

    def block_capacity(self) -> int:
        """Block columns a padded step layout may have before the store's buffers grow (the
        annotations' capacity: the blocks after the completed ones read 0)."""
        return self._annotations.capacity

    def block_counts(self) -> torch.Tensor:
        """int32 ``[2]`` on the store's device: ``(num_blocks, tail_len)``, where the kernels
        read the tail block's column and fill (a step captured in a graph replays as the tail
        fills, :mod:`certkv.graphs`; a layout padded with empty blocks keeps its launches while
        blocks complete)."""
        return self._counts

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size + self.tail_len

    def graph_signature(self) -> tuple | None:
        """What a captured step over this store depends on besides device memory (the step's
        layout padded to :meth:`block_capacity`, :mod:`certkv.graphs`): the lengths of the
        buffers it reads in place (any growth reallocates one) and, for a store of several
        precisions, the completed blocks (each precision's block list changes with every
        completion); None for a store whose layout can change at any step (age stages, a byte
        budget, eviction, protection, a tracker that adapts the precisions to the certificates:
        their steps run eagerly)."""
        if (self.stages.last or self.quantizer.budget_bytes is not None
                or self._evictor is not None or self.protection.enabled
                or self._tracker is not None):
            return None
        sizes = (self._annotations.capacity, self._tier2.capacity, *self._table.capacities(),
                 0 if self._mirror is None else self._mirror.capacity)
        return sizes if self._table.single() is not None else (self.num_blocks, *sizes)

    def single_precision(self) -> Precision | None:
        """The precision holding every completed block, in block order (what the fused kernels
        read in place: :meth:`key_blocks`), or None for a mixed store."""
        pid = self._table.single()
        return None if pid is None else self.precisions[pid]

    def quantized_mask(self, extra: int = 0) -> torch.Tensor:
        """Bool ``[n_blocks]`` on the device: the block is read quantized (not an exact window,
        nor a corrupted block served from its originals); ``extra=1`` appends one False (the
        exact tail block)."""
        mask = self._table.quantized(extra)
        if self._health is None:
            return mask
        corrupted = self.corrupted_mask()
        if extra:
            corrupted = torch.cat([corrupted, corrupted.new_zeros(extra)])
        return mask & ~corrupted

    def num_quantized(self) -> int:
        """Completed blocks read quantized (host count)."""
        if self._health is None:
            return self._table.num_quantized()
        return int(self.quantized_mask().sum())

    def quantized_count(self) -> torch.Tensor:
        """:meth:`num_quantized` as a 0-d int64 tensor on the device, no host read (written in
        place where the table changes, so that a step captured in a graph reads it anew)."""
        if self._health is None:
            return self._table.quantized_count()
        return self.quantized_mask().sum()

    def _single_view(self, which: str, extra: int = 0) -> Blocks:
        pid = self._table.single()
        require(pid is not None, ConfigError,
                "this store mixes precisions; read it with dequantized_keys / _values.")
        return self._table.view(pid, which, extra)

    def key_blocks(self) -> Blocks:
        """Tier-1 key codes and metadata, leading dims ``[Hkv, n_blocks]`` (a store of one
        precision: :meth:`single_precision`)."""
        return self._single_view("key")

    def value_blocks(self) -> Blocks:
        """Tier-1 value codes and metadata, leading dims ``[Hkv, n_blocks]`` (a store of one
        precision)."""
        return self._single_view("value")

    def block_groups(self, which: str) -> list[tuple[Precision, Blocks, torch.Tensor,
                                                     torch.Tensor]]:
        """Per precision holding blocks now: ``(precision, codes, blocks [m], slots [m])``.
        ``codes`` are that precision's ``which`` (``"key"`` or ``"value"``) buffers in slot
        order (leading dims ``[Hkv, slots]``, no copy); ``blocks`` (device int64) are the
        indices of its blocks and ``slots`` their rows in the buffers. What the fused kernels
        read, one launch each."""
        groups = []
        for pid, where, slots in self._table.groups():
            codes = self._step_codes.get((pid, which))  # transient faults: this step's read
            if codes is None:
                codes = self._table.view(pid, which)
            else:
                slots = torch.arange(len(where), device=self.device)
            groups.append((self.precisions[pid], codes, where, slots))
        return self._corrupted_apart(groups, which)

    def value_decode_rounding(self) -> float:
        """The largest ``decode_rounding`` (at this head_dim) of the value codecs holding
        blocks now (the arithmetic bound's value decode term)."""
        held = self._table.held()
        return max(self.precisions[p].value_codec.decode_rounding(self.head_dim) for p in held)

    @property
    def eta(self) -> torch.Tensor:
        """``[Hkv, n_blocks]`` max per-token value reconstruction error (Cor. 4.2)."""
        return self.annotation("eta")

    @property
    def nu(self) -> torch.Tensor:
        """``[Hkv, n_blocks]`` max per-token value l2 norm (Theorem 4.3's V_max per block)."""
        return self._annotations.view()["nu"]

    def annotation(self, name: str, extra: int = 0) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks]`` annotation ``name`` (one of :data:`ANNOTATIONS`);
        ``extra=1`` appends a zero column (the exact tail block), a view."""
        require(name in ANNOTATIONS, ConfigError,
                f"annotation {name!r} is unknown; use one of {list(ANNOTATIONS)}.")
        notes = self._annotations.view(extra)[name]
        if self._health is not None and name in ERROR_NOTES:
            return torch.where(self.corrupted_padded(extra), 0.0, notes)
        return notes

    def corrupted_padded(self, extra: int) -> torch.Tensor:
        """:meth:`corrupted_mask` with ``extra`` False entries appended."""
        corrupted = self.corrupted_mask()
        return torch.cat([corrupted, corrupted.new_zeros(extra)]) if extra else corrupted

    @property
    def centre(self) -> torch.Tensor:
        """FP32 ``[Hkv, d]``: the fixed value centre ``c`` of the centred radius."""
        return self._centre

    def value_radius(self) -> torch.Tensor:
        """``[Hkv]`` upper bound on ``max_t ||v_t - c||_2`` over every token (the centred V_max
        of E_key, :func:`~certkv.certify.bounds.key_error_bound`): the running max of the
        blocks' ``v_radius`` and the tail tokens' radii (kept by append; a view)."""
        return self._value_maxima[1]

    def value_norm_max(self) -> torch.Tensor:
        """``[Hkv]`` upper bound on ``max_t ||v_t||_2`` over every token (V_max, Theorem 4.3):
        the running max of nu_b, and the tail tokens' norms (kept by append; a view)."""
        return self._value_maxima[0]

    def value_error_max(self) -> torch.Tensor:
        """``[Hkv]`` the largest eta_b (0 without quantized blocks): ``||v_hat_t|| <= V_max +
        this`` for every decoded value (the arithmetic bound's value magnitude)."""
        return self._eta_max

    def key_abs_max(self) -> torch.Tensor:
        """FP32 ``[Hkv, d]``: ``max_t |k_{t,c}|`` over every appended key (exact; NaN once a
        NaN key was appended). Bounds the logits' magnitude for the arithmetic bound."""
        return self._key_abs_max

    def tail(self) -> tuple[torch.Tensor, torch.Tensor]:
        """FP16 keys and values of the partial tail block, ``[Hkv, tail_len, d]`` each."""
        return self._tail_k[:, : self.tail_len], self._tail_v[:, : self.tail_len]

    def tail_buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The FP16 tail buffers ``[Hkv, B, d]`` (rows ``>= tail_len`` are stale): kernels read
        the exact tail block in place, masked by ``tail_len``."""
        return self._tail_k, self._tail_v

    def decoded_with_tail(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP32 keys and values ``[Hkv, n, B, d]`` of every block with the partial tail block
        (zero-padded) last, from the decoded mirror (no copy: the values a view of its
        block-major ``[n, Hkv, B, d]``; the keys None where a lean mirror keeps none);
        ``None`` without a mirror."""
        if self._mirror is None:
            return None
        view = self._mirror.view(1 if self.tail_len else 0)
        return view.get("k"), view["v"][0].transpose(0, 1)  # values kept block-major

    def original_keys(self) -> torch.Tensor:
        """FP32 ``[Hkv, n, B, d]``: the FP16 original keys of every block with the partial tail
        block (zero-padded) last: a view of the decoded mirror's copy (kept at append), else
        converted from Tier-2 now. What the PyTorch reference computes FP16-key logits from."""
        require(self.keep_originals or self.lossless, Tier2UnavailableError, TIER2_MISSING)
        extra = 1 if self.tail_len else 0
        if "orig_k" in self._mirror_fields:
            return self._mirror.view(extra)["orig_k"]
        keys = self._originals()["k"].float() if self.num_blocks else torch.zeros(
            self.num_kv_heads, 0, self.block_size, self.head_dim, device=self.device)
        keys = keys.to(self.device)
        if extra:
            tail = torch.zeros(self.num_kv_heads, 1, self.block_size, self.head_dim,
                               device=self.device)
            tail[:, 0, : self.tail_len] = self.tail()[0].float()
            keys = torch.cat([keys, tail], dim=1)
        return keys

    def slot_bias(self) -> torch.Tensor:
        """FP32 ``[n B]``: 0 on every token slot of the step's ``n`` blocks (the partial tail
        block last), ``-inf`` on the tail block's empty slots (a view of the mirror's; computed
        without one)."""
        n = self.num_blocks + (1 if self.tail_len else 0)
        if self._mirror is not None:
            return self._mirror.view(1 if self.tail_len else 0)["bias"].view(-1)
        bias = torch.zeros(n * self.block_size, device=self.device)
        bias[self.num_tokens :] = float("-inf")
        return bias

    def dequantized_keys(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, B, d]`` keys reconstructed from Tier-1 (each block with its
        own codec; corrupted blocks' originals)."""
        return self._read_all("k", lambda: self._table.decode("key"))

    def dequantized_values(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, B, d]`` values reconstructed from Tier-1."""
        return self._read_all("v", lambda: self._table.decode("value"))

    def _read_all(self, name: str, decoded) -> torch.Tensor:
        """Every block's ``name`` as the current step reads it: transient faults' read if there
        is one, else ``decoded()`` with corrupted blocks served from their originals."""
        if self._step_read is not None:
            return self._step_read[name]
        return self._serve_corrupted({name: decoded()}, torch.arange(self.num_blocks))[name]

    def key_channel_bound(self, extra: int = 0) -> torch.Tensor:
        """FP32 ``[Hkv, n_blocks, d]`` per-channel key reconstruction bound (paper 2.3), from the
        stored metadata (cached in the decoded mirror when there is one); ``extra=1`` appends a
        zero block (the exact tail block)."""
        if self._mirror is not None:
            return self._mirror.view(extra)["bound"]
        bound = self._read_all("bound", self._table.channel_bound)
        return torch.cat([bound, bound.new_zeros(bound.shape[0], extra, bound.shape[2])],
                         dim=1) if extra else bound

    # --------------------------------------------------------------- accounting
    def __repr__(self) -> str:
        held = ", ".join(f"{p.name}={p.label}" for p in self.precisions)
        return (f"TieredKVStore(Hkv={self.num_kv_heads}, d={self.head_dim}, B={self.block_size}, "
                f"tokens={self.num_tokens}, {held})")
