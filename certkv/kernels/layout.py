"""The step's view of a store, shared by the orchestrator and the backends.

Blocks are the store's completed blocks (quantized, or exact FP16 windows: ``quantized`` tells
which) followed, if present, by the exact FP16 partial tail block (zero-padded to ``B`` slots;
``valid`` marks the slots in use). Decoded FP32 keys/values
are produced lazily, so a backend that works on the codes (Triton) never decodes the cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from certkv.cache.store import TieredKVStore
from certkv.kernels.triton_sources import BlockSource, block_sources


@dataclass
class StagedBlocks:
    """FP16 blocks paged in for this step: block ``blocks[i]`` of kv head ``kv_heads[i]`` is
    ``data[rows[i]]`` (``data`` a pool such as the scratch cache, read in place) or ``data[i]``
    when ``rows`` is None; ``data: [P, B, d]``, or None for blocks the backend reads from the
    originals itself (the backend's ``in_place``)."""

    kv_heads: torch.Tensor
    blocks: torch.Tensor
    data: torch.Tensor | None
    rows: torch.Tensor | None = None

    def gathered(self) -> torch.Tensor:
        """``[len(blocks), B, d]``: the staged blocks in order (a gather for a pool)."""
        return self.data if self.rows is None else self.data[self.rows]


@dataclass
class SlotMap:
    """FP16 blocks a step reads, located without the host: ``slot [Hkv, n]`` (int32) holds the
    block's row in ``pool [P, B, d]`` (``>= 0``, e.g. the device-side scratch), ``-2 - row`` for
    row ``row`` of Tier-2 read in place (``<= -2``), or -1 (read from its codes)."""

    slot: torch.Tensor
    pool: torch.Tensor


class StepLayout:
    """Masks and annotations of one step over ``n`` blocks of a store. ``empty_tail``: a
    tail block column even when the tail holds no token (its slots all empty), so that the
    layout changes only when a block completes (the device path's kernels, which read the
    tail block's fill from device memory: a step captured in a graph replays over it,
    :mod:`certkv.graphs`). ``read``: make the step's read of Tier-1 (transient faults:
    :meth:`~certkv.cache.store.TieredKVStore.refresh_reads`); False for a second layout of a
    step that made it already, which must see the same words as the first. ``width``: the
    device path's layout padded to that many block columns (more than the completed blocks,
    at most :meth:`~certkv.cache.store.TieredKVStore.block_capacity`): the tail block's
    column, then empty blocks (no token, not quantized, every annotation 0), so that the
    launches stay the same while blocks complete (issue 24's bucketed block counts; the
    kernels read the counts from device memory, :mod:`certkv.kernels.triton_sources`)."""

    def __init__(self, store: TieredKVStore, empty_tail: bool = False, read: bool = True,
                 width: int | None = None) -> None:
        if read:
            store.refresh_reads()  # transient faults: this step's read of Tier-1
        self.store = store
        self._sources: dict[str, list[BlockSource] | None] = {}
        nc, t = store.num_blocks, store.tail_len
        extra = 1 if t or empty_tail else 0  # the exact tail block, last
        if width is not None:  # the tail block, then empty blocks up to a fixed width
            assert nc < width <= store.block_capacity(), (nc, width)
            extra = width - nc
        self.num_completed = nc
        self.num_quantized = store.num_quantized()  # lossy blocks (host count)
        self.quantized_count = store.quantized_count()  # the same, 0-d on the device
        self.num_blocks = nc + extra  # n
        # views the store keeps (a zero column for the tail block): no work per step
        self.quantized = store.quantized_mask(extra)  # [n] (exact: windows, the tail block)
        self.eta = store.annotation("eta", extra)  # [Hkv, n], 0 on the exact tail block
        self.value_spec = store.annotation("value_spec", extra)  # [Hkv, n] ||E^V_b||_2
        self.key_err = store.annotation("key_err", extra)  # [Hkv, n] max_t ||k_hat_t - k_t||
        self.key_spec = store.annotation("key_spec", extra)  # [Hkv, n] ||E^K_b||_2
        self.v_max = store.value_norm_max()  # [Hkv] (Theorem 4.3)
        self.v_radius = store.value_radius()  # [Hkv] max_t ||v_t - c|| (centred Theorem 4.3)

    @property
    def slot_bias(self) -> torch.Tensor:
        """FP32 ``[n B]``: 0 on token slots, ``-inf`` on the tail block's empty ones (what the
        PyTorch reference adds to its logits; the kernels read ``tail_len`` instead)."""
        return self.store.slot_bias()

    def kernel_sources(self, which: str) -> list[BlockSource] | None:
        """The fused kernels' launches over this step's ``which`` (``"key"`` or ``"value"``)
        codes: :func:`~certkv.kernels.triton_sources.block_sources`, built once per step (a
        phase and the rounding chain both ask)."""
        if which not in self._sources:
            self._sources[which] = block_sources(self.store, which,
                                                 self.num_blocks > self.num_completed)
        return self._sources[which]

    @cached_property
    def valid(self) -> torch.Tensor:
        """Bool ``[n, B]``: token slots in use (all but the tail block's empty ones)."""
        return (self.slot_bias == 0).view(self.num_blocks, self.store.block_size)

    @property
    def channel_bound(self) -> torch.Tensor:
        """FP32 ``[Hkv, n_c, d]`` per-channel key error bounds of the completed blocks (0 on
        exact ones; fused kernels skip this)."""
        return self.store.key_channel_bound()

    @property
    def original_keys(self) -> torch.Tensor:
        """FP32 ``[Hkv, n, B, d]`` FP16 original keys of every block, the exact tail block
        last (:meth:`~certkv.cache.store.TieredKVStore.original_keys`)."""
        return self.store.original_keys()

    @property
    def key_bound(self) -> torch.Tensor:
        """FP32 ``[Hkv, n, d]``: :attr:`channel_bound` with the exact tail block's zeros (a
        view where the store keeps them)."""
        return self.store.key_channel_bound(self.num_blocks - self.num_completed)

    @cached_property
    def keys(self) -> torch.Tensor:
        """FP32 ``[Hkv, n, B, d]`` reconstructed keys (exact tail block last): the decoded
        mirror's, else decoded now."""
        mirrored = self.store.decoded_with_tail()
        if mirrored is not None and mirrored[0] is not None:
            return mirrored[0]
        return self._with_tail(self.store.dequantized_keys(), 0)

    @cached_property
    def values(self) -> torch.Tensor:
        """FP32 ``[Hkv, n, B, d]`` reconstructed values (exact tail block last): the decoded
        mirror's, else decoded now."""
        mirrored = self.store.decoded_with_tail()
        if mirrored is not None and mirrored[1] is not None:
            return mirrored[1]
        return self._with_tail(self.store.dequantized_values(), 1)

    def _with_tail(self, blocks: torch.Tensor, which: int) -> torch.Tensor:
        """``blocks [Hkv, n_c, B, d]`` with the zero-padded tail block's keys (``which`` 0) or
        values (1) appended where the store has a tail."""
        store = self.store
        if not store.tail_len:
            return blocks
        return torch.cat([blocks, pad_block(store.tail()[which], store.block_size)], dim=1)


def pad_block(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """FP16 ``[Hkv, t, d]`` (t < B) -> FP32 block ``[Hkv, 1, B, d]`` zero-padded."""
    out = torch.zeros(x.shape[0], 1, block_size, x.shape[2], device=x.device)
    out[:, 0, : x.shape[1]] = x.float()
    return out
