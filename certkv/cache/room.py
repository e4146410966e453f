"""Whether an append leaves room in a Tier-1 budget, decided before the append changes anything.

A store under a budget (``KVQuantizer.budget_bytes``, graduating blocks early; or an eviction
policy's ``evict.budget``, evicting blocks to their summaries) raises
:class:`~certkv.errors.BudgetError` when even its cheapest arrangement of the blocks exceeds
the budget. Found after an append, the store would already hold the new tokens and the moves
made on the way; :func:`check_room` finds it first, from host bookkeeping alone.

After an append that completes ``n`` blocks, block ``b`` is held at its stage's precision
(:class:`~certkv.cache.stages.Stages` aged to the new length) unless evicted. The cheapest
Tier-1 the store can reach:

* under ``budget_bytes``: every block that may graduate early at the last stage's precision,
  the others at their stage's; over ``budget_bytes`` is what :meth:`TieredKVStore._graduate`
  refuses;
* under eviction: the policy's protected blocks (asked of the store as it will be) at their
  own precision, every other block at its summary; over ``budget x`` the completed blocks'
  dense bytes is what :meth:`EvictionTracker.rebalance` refuses.

Where a precision tracker re-allocates widths after an append (SmartKV), a block counts at the
cheapest precision the quantizer may hold it at: a lower bound, so the check never refuses an
append that fits (and such a store can still refuse one after it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import BudgetError, require


@dataclass
class _After:
    """The shape of a store after the append, as an eviction policy reads it."""

    num_blocks: int
    num_tokens: int
    block_size: int
    num_kv_heads: int
    head_dim: int


def check_room(store, n_new: int, seq_len: int, prefill: bool) -> None:
    """Raise the :class:`BudgetError` that ``store`` would raise after an append completing
    ``n_new`` blocks (``seq_len`` tokens then; ``prefill``: the first append), before it."""
    evictor, budget = store._evictor, store.quantizer.budget_bytes
    if not n_new or (evictor is None and budget is None):
        return
    stages = store.stages.clone()
    stages.add(n_new, seq_len)
    stages.due(seq_len)
    bytes_at = store.precision_block_bytes()
    own = _own_bytes(store, stages, seq_len, bytes_at)  # [n + n_new]
    evicted = torch.cat([store.evicted_mask(), torch.zeros(n_new, dtype=torch.bool)])
    if budget is not None:
        last = bytes_at[store.quantizer.stage_precision(stages.last, seq_len)]
        early = torch.zeros_like(evicted)
        early[stages.early()] = True
        summary = bytes_at[store.evicted_pid] if store.evicted_pid is not None else 0.0
        least = torch.where(evicted, summary, torch.where(early, torch.minimum(own, last), own))
        require(float(least.sum()) <= budget, BudgetError,
                f"Tier-1 would need {float(least.sum()):.0f} bytes for {seq_len} tokens even "
                f"with every block at the last stage, over budget_bytes={budget}; raise the "
                "budget or choose a smaller last-stage precision.")
    if evictor is not None and not (prefill and evictor.policy.prompt_window):
        _check_eviction_room(store, evictor, own, n_new, seq_len)


def _own_bytes(store, stages, seq_len: int, bytes_at: torch.Tensor) -> torch.Tensor:
    """FP64 ``[n + n_new]``: each block's bytes at its stage's precision after the append (the
    cheapest the quantizer may hold, where a tracker re-allocates widths)."""
    by_stage = torch.tensor([store.quantizer.stage_precision(s, seq_len)
                             for s in range(stages.last + 1)], dtype=torch.long)
    own = bytes_at[by_stage[stages.stage]]  # one lookup per stage, not per block
    if hasattr(store._tracker, "appended"):  # widths re-allocated after the append
        held = [p for p in range(len(store.precisions))
                if p != store.evicted_pid and store.quantizer.may_hold(p)]
        own = torch.minimum(own, bytes_at[held].min())
    return own


def eviction_floor(store, evictor, own: torch.Tensor, n_new: int = 0,
                   seq_len: int | None = None) -> tuple[float, float]:
    """``(least, dense)``: the Tier-1 bytes of ``store`` after an append of ``n_new`` blocks
    (``seq_len`` tokens then; default: the store as it is) with every block the policy protects
    at its bytes in ``own [n + n_new]`` and every other one at its summary, and the completed
    blocks' dense FP16 bytes (the budget's denominator). ``least / dense`` is the smallest
    budget the policy can meet there."""
    from certkv.evict.tracker import completed_dense_bytes  # the budget's own denominator

    after = _After(store.num_blocks + n_new, store.num_tokens if seq_len is None else seq_len,
                   store.block_size, store.num_kv_heads, store.head_dim)
    protected = evictor.policy.protected(after, evictor)
    summary = float(store.block_bytes(store.evicted_pid))
    least = float(own[protected].sum()) + summary * int((~protected).sum())
    return least, float(completed_dense_bytes(after))


def _check_eviction_room(store, evictor, own: torch.Tensor, n_new: int, seq_len: int) -> None:
    """The eviction policy's refusal (:meth:`EvictionTracker.rebalance`), before the append."""
    least, dense = eviction_floor(store, evictor, own, n_new, seq_len)
    limit = evictor.policy.budget * dense
    require(least <= limit, BudgetError,
            f"Tier-1 would need {least:.0f} bytes with every unprotected block evicted, over "
            f"the {evictor.policy.name} budget of {limit:.0f} bytes "
            f"(evict.budget={evictor.policy.budget}); raise the budget or protect fewer tokens.")
