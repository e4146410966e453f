"""SmartKV's run-time state: per-layer block importance from each step's own attention, the
cross-layer board, and the reallocation of block widths (seed 001; rules in
:mod:`certkv.quant.smartkv`, allocation in :mod:`certkv.quant.allocation`).

Per decode step and layer (device ops only, no host read): the block masses ``rho [Hq, n]`` and
bound shares of the step's certificate (:class:`~certkv.certify.certificate.BlockStats`) update

* ``ema [n_blocks]``: the EMA of ``mean_h rho_hb`` (the partial tail block's EMA carries over to
  the block it becomes, so a block's EMA is the sum of its tokens' EMAs);
* ``weighted [n_blocks]``: ``mean_h w_h rho_hb`` of the latest step, with the head weights
  (the importance rule only);
* ``sensitivity [n_blocks]``: the EMA of the block's bound share divided by its width's step
  (the certificate rule only).

Every ``f(N)`` steps since the last reallocation the layer asks the cache's
:class:`ImportanceBoard` for the widths at this token count (computed once over every layer's
state, shared by all layers) and re-quantizes the blocks whose width changed from their FP16
originals (Tier-2).
"""

from __future__ import annotations

import weakref

import torch

from certkv.quant.allocation import (
    fit_budget,
    greedy_allocation,
    rank_order,
    realloc_period,
    seed_allocation,
    step_size,
)


class ImportanceBoard:
    """One cache's layers' SmartKV state, so an allocation uses the cross-layer mean and every
    layer gets the same widths per block."""

    def __init__(self) -> None:
        self.layers: dict[int, SmartKVTracker] = {}
        self._cached: tuple[tuple, torch.Tensor] | None = None  # (count, blocks, kind), widths

    def scores(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Cross-layer ``(ema, weighted, sensitivity)`` ``[n]`` each (FP64, host), the means
        over the layers that track ``n`` blocks."""
        trackers = [t for t in self.layers.values() if t.ema.numel() == n]
        ema = torch.stack([t.ema for t in trackers]).double().mean(dim=0).cpu()
        weighted = torch.stack([t.weighted for t in trackers]).double().mean(dim=0).cpu()
        sens = torch.stack([t.sensitivity for t in trackers]).double().mean(dim=0).cpu()
        return ema, weighted, sens

    def widths(self, tracker: SmartKVTracker, kind: str) -> torch.Tensor:
        """The widths ``[n]`` for ``tracker``'s store at its current token count: a new
        allocation (``kind="allocate"``) or its current widths stepped down to the budget
        (``"fit"``). Computed once per token count and kind over the cross-layer signals; every
        layer asking at the same count gets the same widths."""
        store = tracker.store
        key = (store.num_tokens, store.num_blocks, kind)
        if self._cached is None or self._cached[0] != key:
            self._cached = (key, tracker.widths_for(kind, *self.scores(store.num_blocks)))
        return self._cached[1]


class SmartKVTracker:
    """One layer's SmartKV state and reallocation (module docstring)."""

    def __init__(self, policy, store) -> None:
        policy.validate(store.head_dim)
        self.policy, self._store = policy, weakref.ref(store)  # the store owns this
        self.board = ImportanceBoard()
        self.board.layers[0] = self
        device = store.device
        self.ema = torch.zeros(0, device=device)
        self.weighted = torch.zeros(0, device=device)
        self.sensitivity = torch.zeros(0, device=device)
        self.tail_ema = torch.zeros((), device=device)
        self.head_eta: torch.Tensor | None = None  # [Hq], eta_h(0) = 1
        self.steps_since = 0
        self.reallocations = 0
        bits = [p.key_codec.bits for p in store.precisions]  # 16 for the exact tail's
        self._pid_bits = torch.tensor(bits)
        self._pid_steps = torch.tensor([step_size(b) if 0 < b < 16 else 1.0 for b in bits],
                                       device=device)

    # ------------------------------------------------------------------ wiring
    @property
    def store(self):
        """The store this tracker belongs to (a weak reference: no cycle keeps a dropped
        store's tensors alive until the garbage collector runs)."""
        return self._store()

    def join(self, board: ImportanceBoard, layer: int) -> None:
        """Share ``board`` with the other layers of the same cache."""
        self.board = board
        board.layers[layer] = self

    def clone_for(self, store) -> SmartKVTracker:
        """A copy of this state for a cloned ``store`` (on its own board until it joins one)."""
        new = SmartKVTracker(self.policy, store)
        for name in ("ema", "weighted", "sensitivity", "tail_ema"):
            setattr(new, name, getattr(self, name).clone())
        new.head_eta = None if self.head_eta is None else self.head_eta.clone()
        new.steps_since, new.reallocations = self.steps_since, self.reallocations
        return new

    # ------------------------------------------------------------------ state
    def _grow(self) -> None:
        """Follow the store's block count: the tail's EMA moves to the block it became."""
        n, have = self.store.num_blocks, self.ema.numel()
        if n == have:
            return
        new = torch.zeros(n - have, device=self.ema.device)
        new[0] = self.tail_ema
        self.tail_ema = torch.zeros_like(self.tail_ema)
        self.ema = torch.cat([self.ema, new])
        self.weighted = torch.cat([self.weighted, torch.zeros_like(new)])
        self.sensitivity = torch.cat([self.sensitivity, torch.zeros_like(new)])

    def _widths_now(self) -> torch.Tensor:
        """Current widths ``[n]`` (host) from the store's precision ids."""
        return self._pid_bits[self.store.block_precision]

    def protected(self) -> torch.Tensor:
        """Bool ``[n]``: blocks holding one of the first ``k_critical`` tokens."""
        first = torch.arange(self.store.num_blocks) * self.store.block_size
        return first < self.policy.k_critical

    def observe(self, certificate) -> None:
        """Fold one step's block signals in; reallocate when ``f(N)`` steps have passed."""
        stats = certificate.blocks
        if stats is None:
            return
        self._grow()
        n, gamma = self.ema.numel(), self.policy.gamma
        mass = stats.mass.detach().float()  # [Hq, n (+ tail)]
        self.ema = gamma * self.ema + (1 - gamma) * mass[:, :n].mean(dim=0)
        if mass.shape[1] > n:
            self.tail_ema = gamma * self.tail_ema + (1 - gamma) * mass[:, n].mean()
        if self.policy.rule == "certificate":  # each rule's own signal only
            steps = self._pid_steps[self.store.block_precision.to(mass.device)]
            share = stats.error.detach().float()[:, :n].mean(dim=0) / steps
            self.sensitivity = gamma * self.sensitivity + (1 - gamma) * share
        else:
            weights = self._head_weights(mass)
            self.weighted = (weights[:, None] * mass[:, :n]).mean(dim=0)
        self.steps_since += 1
        if self.steps_since >= realloc_period(self.store.num_tokens):
            self.reallocate()

    def _head_weights(self, mass: torch.Tensor) -> torch.Tensor:
        """``w_h = eta_h / mean(eta)`` after ``eta_h <- 0.95 eta_h + 0.05 signal_h``."""
        if self.head_eta is None:
            self.head_eta = torch.ones(mass.shape[0], device=mass.device)
        if self.policy.head_signal == "mean":  # the seed: mean attention over N tokens = 1/N
            signal = mass.sum(dim=1) / max(self.store.num_tokens, 1)
        else:
            signal = mass.amax(dim=1)
        self.head_eta = 0.95 * self.head_eta + 0.05 * signal
        return self.head_eta / (self.head_eta.mean() + 1e-12)

    # ------------------------------------------------------------------ allocation
    def scores(self, ema: torch.Tensor, weighted: torch.Tensor) -> torch.Tensor:
        """``I_final [n]`` from cross-layer ``ema`` and ``weighted`` (module docstring of
        :mod:`certkv.quant.smartkv`)."""
        n, block = ema.numel(), self.store.block_size
        age = self.store.num_tokens - (torch.arange(n, dtype=torch.float64) + 1) * block
        recent = ema * torch.exp(-age / self.policy.recency)
        mix = self.policy.head_mix
        return (1 - mix) * _unit_mean(recent) + mix * _unit_mean(weighted)

    def widths_for(self, kind: str, ema: torch.Tensor, weighted: torch.Tensor,
                   sensitivity: torch.Tensor) -> torch.Tensor:
        """Widths ``[n]`` from cross-layer signals: a new allocation under the policy's rule
        (``kind="allocate"``), or the current widths with the least important blocks stepped
        down until the budget holds (``"fit"``)."""
        # evicted blocks (an eviction policy's summaries) are outside SmartKV's widths
        policy, protected = self.policy, self.protected() | self.store.evicted_mask()
        cost, budget = policy.cost(self.store.head_dim), policy.budget()
        certificate = policy.rule == "certificate"
        if kind == "fit":
            order = rank_order(sensitivity if certificate else self.scores(ema, weighted))
            return fit_budget(self._widths_now(), order, protected, cost, budget,
                              upgrade=False)
        if certificate:
            return greedy_allocation(sensitivity, protected, cost, budget)
        return seed_allocation(self.scores(ema, weighted), protected, cost, budget)

    def reallocate(self) -> None:
        """Apply a new allocation to this layer's blocks (re-quantized from Tier-2)."""
        self._apply(self.board.widths(self, "allocate"))
        self.steps_since = 0
        self.reallocations += 1

    def appended(self, prefill: bool) -> None:
        """After an append that completed blocks: allocate the prompt's blocks at once
        (prefill), or step the least important blocks down if new 8-bit blocks broke the
        budget (never raising any: that waits for the next reallocation)."""
        self._grow()
        if prefill:
            self.reallocate()
        else:
            self._apply(self.board.widths(self, "fit"))

    def _apply(self, widths: torch.Tensor) -> None:
        changed = widths != self._widths_now()
        for bits in widths[changed].unique().tolist():
            blocks = (changed & (widths == bits)).nonzero(as_tuple=True)[0]
            self.store.hold(blocks, self.policy.pid(int(bits)))


def _unit_mean(x: torch.Tensor) -> torch.Tensor:
    """``x / (mean x + eps)`` (the seed's normalisation)."""
    return x / (x.mean() + 1e-12) if x.numel() else x

