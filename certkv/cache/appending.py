"""Writing a :class:`~certkv.cache.store.TieredKVStore`: appends (the prompt's tokens, a
decode step's one token, a graph's in-place token), the FP16 tail block and what a completed
block sets off (commit, later stages, the budget, the trackers).

Every tail token goes through one writer, :meth:`Appending._write_tail`, which keeps the tail
buffers, the tail's value maxima and the decoded mirror's tail row together; the CPU's
one-token numba call (:mod:`certkv.cache.append_cpu`) computes the same numbers in one loop.
Shapes: ``k, v [Hkv, T, d]``; tail buffers ``[Hkv, B, d]``; maxima ``[2, Hkv]``.
"""

from __future__ import annotations

import numpy as np
import torch

from certkv.cache import append_cpu, room
from certkv.cache.annotations import INFLATE
from certkv.certify.bounds import centred_radius
from certkv.errors import ConfigError, NonFiniteError, ShapeError, require
from certkv.quant import LayerContext
from certkv.quant.base import round_up_fp32

NONFINITE_KV = ("k or v holds NaN or Inf (or values beyond the FP16 range); fix the model outputs "
                "before caching them.")


class Appending:
    """The store's writing half (a base of :class:`~certkv.cache.store.TieredKVStore`, whose
    buffers it writes: the tail, the running maxima, the centre, the decoded mirror's tail row;
    committing blocks is the store's :meth:`_commit_blocks`)."""

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
            self._write_tail(k16, v16, torch.arange(start, self.tail_len, device=self.device))
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
        k16, v16 = k.to(self.device, torch.float16), v.to(self.device, torch.float16)
        tails, maxima, mirror_rows, scratch = self._append_views()
        finite = append_cpu.append(  # the maxima updated in place (NumPy views of them)
            k16.view(torch.int16).numpy(), v16.view(torch.int16).numpy(), *tails,
            self.tail_len, *maxima, INFLATE, self._mirror is not None, *mirror_rows, scratch)
        require(finite, NonFiniteError, NONFINITE_KV)
        self._step_read, self._step_codes = None, {}
        self.tail_len += 1
        if self.stages.last or self.quantizer.budget_bytes is not None:
            self._graduate()
        return True

    def _append_views(self) -> tuple[tuple, tuple, tuple, np.ndarray]:
        """The NumPy views :meth:`_append_token` reads and writes through: the tail buffers'
        bits, the centre and the running maxima, the decoded mirror's tail row (keys, original
        keys, values, slot bias; placeholders without a mirror), and its FP32 scratch ``[2, 1,
        d]``; made again only when those buffers are not the ones they view."""
        spare = self._mirror.spare_view() if self._mirror is not None else None
        cached = self._views
        maxima = (self._centre, self._key_abs_max, self._block_maxima, self._tail_maxima,
                  self._value_maxima)
        sources = (spare, self._tail_k, *maxima)
        if cached is not None and all(a is b for a, b in zip(cached[0], sources, strict=True)):
            return cached[1]
        unused = torch.zeros(self.num_kv_heads, self.block_size, self.head_dim)  # written only
        rows = ((*(spare[name][:, 0] if name in spare else unused for name in ("k", "orig_k")),
                 spare["v"][0, 0] if "v" in spare else unused, spare["bias"][:, 0])
                if spare is not None else (torch.zeros(1, 1, 1),) * 3 + (torch.zeros(1, 1),))
        views = (tuple(x.view(torch.int16).numpy() for x in (self._tail_k, self._tail_v)),
                 tuple(x.numpy() for x in maxima), tuple(x.numpy() for x in rows),
                 np.empty((2, 1, self.head_dim), np.float32))
        self._views = (sources, views)
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
        self._write_tail(pending_k[:, cut:], pending_v[:, cut:],
                         torch.arange(self.tail_len, device=self.device), restarted=True)

    def _write_tail(self, k16: torch.Tensor, v16: torch.Tensor, slots: torch.Tensor,
                    restarted: bool = False) -> None:
        """The one writer of tail tokens, on every path (an append's, a commit's new tail, a
        graph's in-place token; the CPU's one-token numba call computes the same, see
        :meth:`_append_token`): ``k16, v16 [Hkv, t, d]`` into tail rows ``slots [t]`` (a device
        tensor: a graph's slot is read from device memory), folded into the tail's value maxima
        (after a block completed, ``restarted``: the old maxima go) and the running ones, and
        into the decoded mirror's tail row, the row after the completed blocks, so that a step
        reads all three as they are."""
        self._tail_k.index_copy_(1, slots, k16)
        self._tail_v.index_copy_(1, slots, v16)
        maxima = self._token_maxima(v16)
        if restarted:
            self._tail_maxima.copy_(maxima)
        else:
            torch.maximum(self._tail_maxima, maxima, out=self._tail_maxima)
        torch.maximum(self._block_maxima, self._tail_maxima, out=self._value_maxima)
        if self._mirror is not None and k16.shape[1]:
            rows = self._mirror.buffers()
            at = (slice(None), self._completed_count.long(), slots)
            for name in ("k", "orig_k"):
                if name in rows:
                    rows[name][at] = k16.to(rows[name].dtype)
            if "v" in rows:  # a lean mirror of 4-bit group values keeps none
                rows["v"][0].transpose(0, 1)[at] = v16.to(rows["v"].dtype)
            rows["bias"][at] = 0.0

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
        self._write_tail(k16, v16, self._tail_count.long())
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
