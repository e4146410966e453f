"""Reading a :class:`~certkv.cache.store.TieredKVStore`: counts, the step's block views and
precisions, annotations and running maxima, the tail, the decoded mirror and the originals as
the kernels and the certificate read them.

Shapes: block tensors ``[Hkv, n, B, d]``; per-block annotations ``[Hkv, n]`` (``extra`` zero
columns after them: the tail block and a padded layout's empty blocks); maxima ``[Hkv]``.
"""

from __future__ import annotations

import torch

from certkv.cache.annotations import ANNOTATIONS, ERROR_NOTES
from certkv.cache.originals import TIER2_MISSING
from certkv.errors import ConfigError, Tier2UnavailableError, require
from certkv.quant import Blocks
from certkv.quant.precision import Precision


class StoreViews:
    """The store's reading half (a base of :class:`~certkv.cache.store.TieredKVStore`, whose
    buffers it reads without changing them)."""

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

    @property
    def has_decoded_mirror(self) -> bool:
        """Whether a decoded mirror is kept (:meth:`decoded_with_tail` is not None)."""
        return self._mirror is not None

    def decoded_with_tail(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """FP32 keys and values ``[Hkv, n, B, d]`` of every block with the partial tail block
        (zero-padded) last, from the decoded mirror (no copy: the values a view of its
        block-major ``[n, Hkv, B, d]``; keys or values None where a lean mirror keeps none);
        ``None`` without a mirror."""
        if self._mirror is None:
            return None
        view = self._mirror.view(1 if self.tail_len else 0)
        values = view.get("v")  # kept block-major
        return view.get("k"), None if values is None else values[0].transpose(0, 1)

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
