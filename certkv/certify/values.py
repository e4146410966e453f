"""Value policies: which blocks read FP16 values from Tier-2 (paper 3.4 rung 2, Corollary 4.2).

A policy sees, per query head, the Phase-1 block log-masses ``log_p_hat: [Hq, n]`` (normalised;
logs so that masses that underflow FP32 keep their meaning), the stored value
errors ``eta: [Hq, n]`` (0 for blocks whose values are exact) and the head's ``delta: [Hq]``
(max score perturbation over quantized blocks), and returns a boolean promotion mask ``[Hq, n]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require


@dataclass
class LocalThreshold:
    """Default policy: promote block ``b`` if ``p_hat_b * eta_b > v_tol`` (Table 2, v_tol=0.05).

    A local heuristic: it does not by itself bound the global E_val (paper 9.6).
    """

    v_tol: float = 0.05

    def __post_init__(self) -> None:
        require(self.v_tol >= 0, ConfigError, f"v_tol={self.v_tol} must be >= 0, e.g. 0.05.")

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor):
        return log_p_hat.exp() * eta > self.v_tol


@dataclass
class GreedyBudget:
    """Hard budget: promote by descending ``rho_ub_b * eta_b`` until E_val <= ``e_val_budget``.

    ``rho_ub_b = min(1, e^{2 Delta} p_hat_b)`` upper-bounds the Phase-2 block mass (Lemma A.1:
    Phase-1 and Phase-2 logits differ by at most Delta per token), so the achieved
    ``E_val = sum rho_b eta_b`` is at most the budget once the policy has run (Cor. 4.2).
    """

    e_val_budget: float = 0.05

    def __post_init__(self) -> None:
        require(self.e_val_budget >= 0, ConfigError,
                f"e_val_budget={self.e_val_budget} must be >= 0, e.g. 0.05.")

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor):
        rho_ub = torch.exp((2.0 * delta.unsqueeze(-1) + log_p_hat).clamp(max=0.0))
        contribution = rho_ub * eta
        ranked, order = torch.sort(contribution, dim=-1, descending=True, stable=True)
        # suffix sums (what is left if blocks j.. stay INT4), summed from the small end so tiny
        # contributions are not lost to cancellation against the total
        remaining = torch.flip(torch.cumsum(torch.flip(ranked, [-1]), dim=-1), [-1])
        needed = (remaining > self.e_val_budget) & (ranked > 0)
        return torch.zeros_like(needed).scatter(-1, order, needed)


@dataclass
class NoValuePromotion:
    """Never promote values (naive mode, or INT4 values only)."""

    def select(self, log_p_hat: torch.Tensor, eta: torch.Tensor, delta: torch.Tensor):
        return torch.zeros_like(log_p_hat, dtype=torch.bool)
