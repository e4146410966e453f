"""Value policies: which blocks read FP16 values from Tier-2 (paper 3.4 rung 2, Corollary 4.2).

A policy sees, per query head, the Phase-1 block log-masses ``log_p_hat: [..., n]``
(normalised; logs so that masses that underflow FP32 keep their meaning), the stored value
errors ``eta`` (0 for blocks whose values are exact), ``delta``: a bound on how far Phase 2's
logits move from Phase 1's, per block ``[..., n]`` (the attention step passes ``Delta_b`` on the
blocks whose FP16 keys Phase 2 reads, 0 elsewhere) or per head ``[...]``, and, for the tight
contribution, the Phase-1 block
log-spreads ``log_spread: [..., n]`` (``log ||p_hat_b||_2``) and the value-error spectral
norms ``sigma``; it returns a boolean promotion mask ``[..., n]``. The leading dims are the
query heads (``[Hq]``, or ``[Hkv, G]`` grouped by kv head, as the attention step passes them);
``eta`` and ``sigma`` broadcast against them (``[Hkv, 1, n]``: one row per kv head).

``contribution`` picks the per-block value error the policy weighs, the same one the
certificate charges (:func:`~certkv.certify.bounds.value_block_terms`):

* ``tight`` (default): ``min(p_b eta_b, sigma_b ||p_b||_2)``;
* ``paper``: ``p_b eta_b`` (Corollary 4.2, the paper's exact rule, for reproduction).

The tight contribution never exceeds the paper's, so a tight policy promotes a subset of the
blocks the paper's rule promotes, and every block it leaves quantized still contributes at most
``v_tol`` to the certified E_val.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require
from certkv.registry import VALUE_POLICIES, inherits

CONTRIBUTIONS = ("tight", "paper")


def _check_contribution(contribution: str) -> None:
    require(contribution in CONTRIBUTIONS, ConfigError,
            f"value_policy.contribution={contribution!r} is unknown; use 'tight' or 'paper'.")


def fewest_covering(terms: torch.Tensor, limit: float | torch.Tensor) -> torch.Tensor:
    """Bool like ``terms [..., m]`` (non-negative): per row, the fewest entries whose removal
    leaves the rest summing to at most ``limit`` (a number, or ``[...]`` per row), the largest
    first (ties in index order). No smaller set does: any ``j`` entries removed leave at least
    the sum of all but the ``j`` largest."""
    if isinstance(limit, torch.Tensor):
        limit = limit.unsqueeze(-1)
    ranked, order = torch.sort(terms, dim=-1, descending=True, stable=True)
    # suffix sums (what is left if entries j.. stay), summed from the small end so tiny terms
    # are not lost to cancellation against the total
    remaining = torch.flip(torch.cumsum(torch.flip(ranked, [-1]), dim=-1), [-1])
    needed = (remaining > limit) & (ranked > 0)
    return torch.zeros_like(needed).scatter(-1, order, needed)


def contribution_of(mass: torch.Tensor, eta: torch.Tensor, contribution: str,
                    spread: torch.Tensor | None, sigma: torch.Tensor | None) -> torch.Tensor:
    """Per-block value error ``[Hq, n]`` for (an estimate or upper bound of) the block masses
    ``mass`` and spreads ``spread``: ``mass * eta``, or with ``tight`` and spreads known
    ``min(mass * eta, spread * sigma)``."""
    paper = mass * eta
    if contribution == "paper" or spread is None or sigma is None:
        return paper
    return torch.minimum(paper, spread * sigma)


def phase2_mass_factor(log_p_hat: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``log F_b [..., n]`` with every Phase-2 block mass ``rho_b <= F_b p_hat_b`` and token
    weight ``p_t <= F_b p_hat_t`` (``t`` in ``b``), for Phase-1 block log-masses ``log_p_hat
    [..., n]`` (normalised) and ``delta``: the head's ``Delta [...]`` (every Phase-2 logit
    within ``Delta`` of its Phase-1 one: ``F_b = e^{2 Delta}``, Lemma A.1), or per block ``[...,
    n]`` the bound ``Delta'_b`` on block ``b``'s logit shift (``Delta_b`` where Phase 2 reads
    its FP16 keys, 0 where it reuses Phase 1's logits). Then ``e^{s2_t} <= e^{Delta'_b}
    e^{s1_t}`` and the normaliser ``Z2 >= Z1 sum_c e^{-Delta'_c} p_hat_c``, so ``F_b =
    e^{Delta'_b} / sum_c e^{-Delta'_c} p_hat_c``: never above ``e^{2 max_c Delta'_c}``, and a
    block whose logits Phase 2 does not move (an evicted block's loose summary among them)
    adds nothing to the others'."""
    if delta.dim() < log_p_hat.dim():
        return 2.0 * delta.unsqueeze(-1)
    return delta - torch.logsumexp(log_p_hat - delta, dim=-1, keepdim=True)


class ValuePolicy:
    """Base of value policies: which blocks' values a step reads in FP16 (paper 3.4). The
    step asks a policy what it can do (:meth:`fuses_on_cpu`), never its type."""

    def fuses_on_cpu(self) -> bool:
        """Whether :mod:`certkv.certify.fused_select` computes this policy's promotions."""
        return False


@VALUE_POLICIES.register("local")
@dataclass
class LocalThreshold(ValuePolicy):
    """Default policy: promote block ``b`` if its contribution exceeds ``v_tol`` (Table 2,
    v_tol=0.05): ``p_hat_b * eta_b`` (``contribution=paper``) or
    ``min(p_hat_b eta_b, sigma_b ||p_hat_b||_2)`` (``tight``).

    A local heuristic: it does not by itself bound the global E_val (paper 9.6).
    """

    v_tol: float = 0.05
    contribution: str = "tight"

    def __post_init__(self) -> None:
        require(self.v_tol >= 0, ConfigError, f"v_tol={self.v_tol} must be >= 0, e.g. 0.05.")
        _check_contribution(self.contribution)

    def fuses_on_cpu(self) -> bool:
        """Whether the CPU's fused selection computes this policy's promotions (its own
        :meth:`select`, not a subclass's)."""
        return inherits(self, LocalThreshold, "select")

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor,
               log_spread: torch.Tensor | None = None, sigma: torch.Tensor | None = None):
        spread = None if log_spread is None else log_spread.exp()
        return contribution_of(log_p_hat.exp(), eta, self.contribution, spread,
                               sigma) > self.v_tol


@VALUE_POLICIES.register("greedy")
@dataclass
class GreedyBudget(ValuePolicy):
    """Hard budget: promote by descending contribution until E_val <= ``e_val_budget``.

    ``rho_ub_b = min(1, F_b p_hat_b)`` upper-bounds the Phase-2 block mass and ``F_b
    ||p_hat_b||_2`` its spread (:func:`phase2_mass_factor`: ``F_b = e^{2 Delta}`` from the head's
    ``Delta``, Lemma A.1, or the tighter per-block factor where the step passes each block's
    logit shift). The contribution is ``rho_ub_b eta_b`` (``paper``) or ``min(rho_ub_b eta_b,
    sigma_b spread_ub_b)`` (``tight``), so the achieved E_val of the same form (Cor. 4.2,
    sharpened) is at most the budget once the policy has run.
    """

    e_val_budget: float = 0.05
    contribution: str = "tight"

    def __post_init__(self) -> None:
        require(self.e_val_budget >= 0, ConfigError,
                f"e_val_budget={self.e_val_budget} must be >= 0, e.g. 0.05.")
        _check_contribution(self.contribution)

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor,
               log_spread: torch.Tensor | None = None, sigma: torch.Tensor | None = None):
        inflate = phase2_mass_factor(log_p_hat, delta)
        rho_ub = torch.exp((inflate + log_p_hat).clamp(max=0.0))
        spread_ub = None if log_spread is None else torch.minimum(
            rho_ub, torch.exp((inflate + log_spread).clamp(max=0.0)))
        contribution = contribution_of(rho_ub, eta, self.contribution, spread_ub, sigma)
        return fewest_covering(contribution, self.e_val_budget)


@VALUE_POLICIES.register("none")
@dataclass
class NoValuePromotion(ValuePolicy):
    """Never promote values (naive mode, or INT4 values only)."""

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor,
               log_spread: torch.Tensor | None = None, sigma: torch.Tensor | None = None):
        return torch.zeros_like(log_p_hat, dtype=torch.bool)
