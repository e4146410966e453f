"""Before a run: the smallest eviction budget a policy can meet (issue 52).

A policy never evicts the blocks it protects (the newest ``min_materialized`` tokens for age,
the prompt's window for SnapKV, ...), so below some budget no eviction can bring Tier-1 under
it and the run would stop at its first certified step with a
:class:`~certkv.errors.BudgetError`, after the records before it were written. The runner asks
:func:`smallest_budget` for every variant before anything is recorded and refuses a budget
under it in one sentence that names the value that works.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from certkv.errors import ConfigError, require


def smallest_budget(quantizer, num_kv_heads: int, head_dim: int, tokens: int,
                    decode_tokens: int = 0) -> float:
    """The smallest ``evict.budget`` at which ``quantizer``'s eviction policy holds a
    ``tokens``-token prompt and the ``decode_tokens`` after it (at least the block the prompt's
    last tokens complete: a policy that protects the prompt's end, SnapKV, protects it).

    At each length it is Tier-1's bytes (:meth:`TieredKVStore.tier1_bytes`) with every block the
    policy protects at its own precision and every other one at its summary, over the completed
    blocks' dense FP16 bytes (the budget's denominator, :meth:`EvictionTracker.limit`); the
    largest over the lengths (:func:`certkv.cache.room.eviction_floor` of the store as each
    append leaves it, unevicted). Byte counts do not depend on the values, so the store is
    filled with random ones; a policy that ranks by the prompt's queries gets random queries.
    0 when no block completes."""
    from certkv.cache.room import eviction_floor
    from certkv.cache.store import TieredKVStore

    probe = quantizer.with_eviction(replace(quantizer.eviction, budget=1.0))  # never evicts
    store = TieredKVStore(num_kv_heads, head_dim, **probe.store_kwargs())
    gen = torch.Generator().manual_seed(0)
    block = store.block_size
    end = tokens + max(decode_tokens, block)
    chunks = [tokens] + [block] * math.ceil((end - tokens) / block)
    need = 0.0
    for i, n in enumerate(chunks):
        k, v = (torch.randn(num_kv_heads, n, head_dim, generator=gen) for _ in range(2))
        store.append(k, v)
        if i == 0 and store._evictor.policy.prompt_window:
            window = min(store._evictor.policy.prompt_window, tokens)
            queries = torch.randn(num_kv_heads, window, head_dim, generator=gen)
            store.observe_prompt(queries, head_dim ** -0.5)
        if store.num_blocks:
            least, dense = eviction_floor(store, store._evictor, store.own_block_bytes())
            need = max(need, least / dense)
    # a relative 1e-9 above the ratio: the budget times the dense bytes, rounded in floating
    # point, must not fall below the bytes (at equality a BudgetError was raised)
    return need * (1 + 1e-9)


def check_budget(name: str, quantizer, num_kv_heads: int, head_dim: int, tokens: int) -> None:
    """Refuse (one sentence naming the budget that works) a variant ``name`` whose eviction
    budget its policy cannot meet on a ``tokens``-token prompt (the shortest of the run: the
    protected share of Tier-1 shrinks as a sequence grows)."""
    policy = getattr(quantizer, "eviction", None)
    if policy is None:
        return
    need = smallest_budget(quantizer, num_kv_heads, head_dim, tokens)
    works = math.ceil(need * 100) / 100
    require(policy.budget >= need, ConfigError,
            f"evict.budget={policy.budget:g} is below what {policy.name} eviction can reach on "
            f"this run's {tokens}-token prompts (variant {name!r}: the blocks it never evicts "
            f"and the summaries of the others take {need:.3f} of the dense bytes); use "
            f"evict.budget={works:g} or more, or a policy that protects fewer tokens.")


def check_batch_memory(task: str, batch_size: int, lm, tokens: int) -> None:
    """Refuse (one sentence) a batch of ``batch_size`` samples of ``tokens`` tokens whose
    prefills and caches would not fit the memory free now, before any is made: each sequence
    holds its dense prefill (the model's dtype) and about two certkv caches (a quantized
    template and the decoding copy, :data:`~certkv.models.hf_cache.BYTES_PER_ELEMENT` bytes per
    element each)."""
    from certkv.models.hf_cache import BYTES_PER_ELEMENT, free_memory

    if batch_size <= 1:
        return
    elements = 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * tokens
    itemsize = torch.finfo(lm.model.dtype).bits // 8
    need = batch_size * elements * (itemsize + 2 * BYTES_PER_ELEMENT)
    free = free_memory(lm.device)
    require(free is None or need <= free, ConfigError,
            f"task.{task}.batch_size={batch_size} needs about {need / 2**30:.1f} GiB for "
            f"{batch_size} sequences of {tokens} tokens but {free / 2**30:.1f} GiB are free; "
            f"lower task.{task}.batch_size.")
