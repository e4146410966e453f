"""EvictionTracker: one layer's eviction state and the moves between a block's precision and
its Tier-1 summary, under the policy's byte budget.

After every append that completes blocks (prefill included) :meth:`rebalance` compares the
store's Tier-1 bytes with ``memory_threshold x budget x`` the completed blocks' dense FP16
bytes. Above it, the policy's protected blocks stay, the others are kept in descending score
order while they fit, and the rest are evicted (held at the summary precision, re-encoded from
Tier-2 like any precision change). A policy that :attr:`restores` may bring evicted blocks back
the same way. Counters: blocks evicted and restored, and per decode step the evicted blocks the
step paged in (keys or values from FP16).
"""

from __future__ import annotations

import weakref

import torch

from certkv.errors import BudgetError, require


def completed_dense_bytes(store) -> int:
    """The budget's denominator: the dense FP16 bytes of ``store``'s completed blocks."""
    return 4 * store.num_kv_heads * store.num_blocks * store.block_size * store.head_dim


class EvictionTracker:
    """One layer's eviction (module docstring); ``mass [n]``: attention received per block,
    summed over steps and averaged over query heads (for :class:`HeavyHitterEviction`)."""

    def __init__(self, policy, store) -> None:
        self.policy, self._store = policy, weakref.ref(store)  # the store owns this
        self.mass = torch.zeros(0, dtype=torch.float64, device=store.device)
        self.evictions = 0
        self.restores = 0
        self.prompt_scores: torch.Tensor | None = None  # [n] at the prompt (SnapKV)
        self.prompt_tokens: int | None = None

    @property
    def store(self):
        """The store this tracker belongs to (a weak reference: no cycle keeps a dropped
        store's tensors alive until the garbage collector runs)."""
        return self._store()

    def clone_for(self, store) -> EvictionTracker:
        new = EvictionTracker(self.policy, store)
        new.mass = self.mass.clone()
        new.evictions, new.restores = self.evictions, self.restores
        new.prompt_scores, new.prompt_tokens = self.prompt_scores, self.prompt_tokens
        return new

    # ------------------------------------------------------------------ signals
    def _grow(self) -> None:
        n = self.store.num_blocks
        if n > self.mass.numel():
            extra = torch.zeros(n - self.mass.numel(), dtype=torch.float64,
                                device=self.mass.device)
            self.mass = torch.cat([self.mass, extra])

    def observe(self, certificate) -> None:
        """Add the step's block masses ``rho_b`` (mean over query heads; device ops only), and
        rebalance if what else adapts to the step (SmartKV's widths) grew Tier-1 past the
        budget."""
        stats = certificate.blocks
        if stats is not None:
            self._grow()
            n = self.mass.numel()
            self.mass += stats.mass.detach()[:, :n].double().mean(dim=0).to(self.mass.device)
        if self.store.tier1_bytes() > self.limit():
            self.rebalance()

    def appended(self, prefill: bool) -> None:
        """After an append that completed blocks; a policy that ranks by the prompt's queries
        waits for them (:meth:`observe_prompt`) after a prefill."""
        self._grow()
        if prefill and self.policy.prompt_window:
            return
        self.rebalance()

    def observe_prompt(self, queries: torch.Tensor, scaling: float) -> None:
        """The prompt's queries ``[Hq, T, d]`` (its last ``T`` positions, after RoPE), for a
        policy with a :attr:`~certkv.evict.base.EvictionPolicy.prompt_window`
        (:meth:`TieredKVStore.observe_prompt` checks): it scores the blocks by them, then the
        budget is enforced."""
        self.prompt_scores = self.policy.prompt_scores(self.store, queries, scaling)
        self.prompt_tokens = self.store.num_tokens
        self.rebalance()

    # ------------------------------------------------------------------ budget
    def limit(self) -> float:
        """The budget in bytes: ``budget x`` the completed blocks' dense FP16 bytes."""
        return self.policy.budget * completed_dense_bytes(self.store)

    def rebalance(self) -> None:
        """Evict (and, for a restoring policy, bring back) blocks so that Tier-1 is within
        ``memory_threshold x`` :meth:`limit`; raises :class:`BudgetError` if even evicting every
        unprotected block cannot meet :meth:`limit`."""
        store, limit = self.store, self.limit()
        target = self.policy.memory_threshold * limit
        evicted = store.evicted_mask()
        if store.tier1_bytes() <= target and not (self.policy.restores and evicted.any()):
            return
        keep = self._choose(target, evicted)
        leave = (~keep & ~evicted).nonzero(as_tuple=True)[0]
        back = (keep & evicted).nonzero(as_tuple=True)[0]
        if len(leave):
            store.evict(leave)
            self.evictions += len(leave)
        if len(back):
            store.restore(back)
            self.restores += len(back)
        require(store.tier1_bytes() <= limit, BudgetError,
                f"Tier-1 needs {store.tier1_bytes()} bytes with every unprotected block "
                f"evicted, over the {self.policy.name} budget of {limit:.0f} bytes "
                f"(evict.budget={self.policy.budget}); raise the budget or protect fewer tokens.")

    def _choose(self, target: float, evicted: torch.Tensor) -> torch.Tensor:
        """Bool ``[n]``: the blocks to hold at their own precision. Protected blocks, then the
        best-scored others while Tier-1 stays within ``target`` (a non-restoring policy never
        chooses an evicted block)."""
        store = self.store
        own = store.own_block_bytes()  # [n] at each block's precision (its own when evicted)
        summary = store.block_bytes(store.evicted_pid)
        protected = self.policy.protected(store, self)
        keep = protected.clone()
        used = float(own[protected].sum()) + summary * int((~protected).sum())
        candidates = ~protected if self.policy.restores else ~protected & ~evicted
        scores = self.policy.scores(store, self).masked_fill(~candidates, float("-inf"))
        for b in torch.argsort(scores, descending=True, stable=True)[: int(candidates.sum())]:
            extra = float(own[b]) - summary
            if used + extra > target:
                break
            keep[b] = True
            used += extra
        return keep
