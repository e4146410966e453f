"""Where a store's blocks live (:class:`~certkv.cache.store.TieredKVStore` inherits this):
stage graduation (tiers by age, early graduation under a byte budget), eviction hold and
restore, the precision trackers (SmartKV's importance, adaptive thresholds) and the stage
boundaries. Works on the store's block table, stages and trackers."""

from __future__ import annotations

import torch

from certkv.errors import BudgetError, ConfigError, require


class Residency:
    """Graduation, eviction and re-quantization of completed blocks."""

    def _graduate(self) -> None:
        """Re-quantize the blocks whose age reached a later stage (from Tier-2), then, over
        the budget's threshold, the oldest blocks early to the last stage."""
        for stage, blocks in self.stages.due(self.num_tokens):
            self._requantize(blocks, stage)
        budget = self.quantizer.budget_bytes
        if budget is None:
            return
        if self.tier1_bytes() > self.quantizer.memory_threshold * budget:
            self._graduate_early(self.quantizer.memory_threshold * budget)
        last = self.precisions[self.quantizer.stage_precision(self.stages.last, self.num_tokens)]
        require(self.tier1_bytes() <= budget, BudgetError,
                f"Tier-1 needs {self.tier1_bytes()} bytes for {self.num_tokens} tokens even with "
                f"every block at {last.label}, over budget_bytes={budget}; raise the budget or "
                "choose a smaller last-stage precision.")

    def _graduate_early(self, target: float) -> None:
        """Move the oldest blocks not at the last stage there, in growing batches, until Tier-1
        is at most ``target`` bytes or none is left."""
        batch = 1
        while self.tier1_bytes() > target:
            candidates = self.stages.early()
            if not len(candidates):
                return
            self._requantize(candidates[:batch], self.stages.last)
            batch *= 2

    def _requantize(self, blocks: torch.Tensor, stage: int) -> None:
        """Hold ``blocks [m]`` (host, ascending) at ``stage``'s precision (:meth:`hold`)."""
        self.hold(blocks, self.quantizer.stage_precision(stage, self.num_tokens))
        self.stages.move(blocks, stage)

    def hold(self, blocks: torch.Tensor, pid: int) -> None:
        """Hold ``blocks [m]`` (host, ascending) at precision ``pid``: re-encoded from their
        FP16 originals (Tier-2, never from their codes), annotations and mirror rows replaced
        with them; Tier-1 frees their old slots. Evicted blocks stay evicted (graduation and
        SmartKV's widths pass them over): only :meth:`restore` brings them back."""
        if self.evicted_pid is not None:
            blocks = blocks[self.block_precision[blocks] != self.evicted_pid]
        self._hold(blocks, pid)

    def evict(self, blocks: torch.Tensor) -> None:
        """Hold ``blocks [m]`` (host, ascending) at their summary only (the eviction policy's
        move; their originals stay in Tier-2)."""
        self._hold(blocks, self.evicted_pid)

    def restore(self, blocks: torch.Tensor) -> None:
        """Bring evicted ``blocks [m]`` back at the precision of their stage."""
        for pid, where in self._stage_pids(blocks):
            self._hold(where, pid)

    def _stage_pids(self, blocks: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """``(pid, blocks)`` groups: the precision each block's stage gives it now."""
        pids = torch.tensor([self.quantizer.stage_precision(int(st), self.num_tokens)
                             for st in self.stages.stage[blocks]], dtype=torch.long)
        return [(pid, blocks[pids == pid]) for pid in pids.unique().tolist()]

    def evicted_mask(self) -> torch.Tensor:
        """Bool ``[n_blocks]`` (host): blocks held at their summary only."""
        if self.evicted_pid is None:
            return torch.zeros(self.num_blocks, dtype=torch.bool)
        return self.block_precision == self.evicted_pid

    def eviction_counts(self) -> dict[str, int]:
        """Blocks evicted now, and evictions / restores so far (zeros without a policy)."""
        ev = self._evictor
        return {"evicted": int(self.evicted_mask().sum()),
                "evictions": ev.evictions if ev else 0, "restores": ev.restores if ev else 0}

    def _hold(self, blocks: torch.Tensor, pid: int) -> None:
        if not len(blocks):
            return
        self._step_read, self._step_codes = None, {}
        originals = self._originals()
        k16 = originals["k"][:, blocks].to(self.device)
        v16 = originals["v"][:, blocks].to(self.device)
        keys, values, notes = self._encode(k16, v16, pid, self._starts(blocks))
        self._table.move(blocks, pid, keys, values)
        self._keep_notes(notes, blocks)
        self._note_maxima(notes)
        if self._mirror is not None:
            self._mirror.put(blocks, self._mirror_rows(self._decoded(blocks)))

    def _new_tracker(self):
        """What adapts this store to the measured certificates: SmartKV's widths
        (:mod:`certkv.quant.importance`), the adaptive tier boundaries, or None."""
        make = getattr(self.quantizer, "new_tracker", None)
        if make is not None:
            return make(self)
        rule = getattr(self.quantizer, "adaptive", None)
        return None if rule is None else rule.tracker(self.stages.ages)

    def observe(self, certificate) -> None:
        """Feed a decode step's certificate to the tracker and the eviction policy (if any)."""
        require(certificate is not None, ConfigError,  # (no f-string: a repr every step)
                "store.observe takes the Certificate a step returned, not None; pass `cert` "
                "from `out, cert = attention(q, store)`.")
        if self._tracker is not None:
            self._tracker.observe(certificate)
        if self._evictor is not None:
            self._evictor.observe(certificate)

    @property
    def wants_prompt(self) -> bool:
        """Does this store's eviction policy rank blocks by the prompt's queries (SnapKV)?"""
        return self._evictor is not None and self._evictor.policy.prompt_window > 0

    def observe_prompt(self, queries: torch.Tensor, scaling: float | None = None) -> None:
        """The prompt's queries ``[Hq, T, d]`` (its last ``T`` positions, after RoPE; the
        store's last ``T`` tokens) for an eviction policy that ranks by them (SnapKV), which
        evicts once it has seen them; a no-op otherwise. ``scaling``: the model's softmax
        scale (default ``1 / sqrt(d)``)."""
        if self.wants_prompt:
            shape = tuple(getattr(queries, "shape", ()))
            require(len(shape) == 3 and shape[2] == self.head_dim and shape[1] >= 1
                    and shape[0] % self.num_kv_heads == 0, ConfigError,
                    f"observe_prompt takes queries [Hq, T, d] with Hq a multiple of "
                    f"{self.num_kv_heads} kv heads and d={self.head_dim}, not {list(shape)}; "
                    "pass the prompt's last queries after RoPE, heads first.")
            scale = self.head_dim**-0.5 if scaling is None else scaling
            self._evictor.observe_prompt(queries, scale)

    def join(self, board, layer: int) -> None:
        """Share cross-layer state (SmartKV's :class:`~certkv.quant.importance.ImportanceBoard`)
        with the other layers of a cache; nothing for other quantizers."""
        self._fault_rng = self._faults.generator(layer)
        if hasattr(self._tracker, "join"):
            self._tracker.join(board, layer)

    @property
    def block_precision(self) -> torch.Tensor:
        """Host ``[n_blocks]``: the precision id of each completed block."""
        return self._table.precision

    @property
    def boundaries(self) -> list[int]:
        """The current stage ages (a tiered quantizer's ``[hot, stale]``)."""
        return list(self.stages.ages)

    @boundaries.setter
    def boundaries(self, ages: list[int]) -> None:
        require(len(ages) == len(self.stages.ages), ConfigError,
                f"boundaries {ages} do not match this quantizer's {len(self.stages.ages)} "
                "stage ages; load thresholds saved for the same quantizer.")
        require(all(0 <= a <= b for a, b in zip([0, *ages], ages, strict=False)), ConfigError,
                f"boundaries {ages} must be non-negative and ascending (ages in tokens, e.g. "
                "[64, 512]).")
        self.stages.ages[:] = [int(a) for a in ages]
        if self.num_blocks:
            self._graduate()
