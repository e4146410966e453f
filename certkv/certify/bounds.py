"""Error bounds of the certificate (paper Section 4 and Appendix A). Pure functions.

Shapes: per-head tensors are ``[Hq]``; block tensors ``[Hq, n_blocks]`` unless stated.
"""

from __future__ import annotations

import torch


def block_deltas(q: torch.Tensor, channel_bound: torch.Tensor, scaling: float) -> torch.Tensor:
    """Per-block score perturbation bound Delta_b (eq. 8, tighter per-block form).

    ``Delta_b = scaling * sum_c |q_c| * r_c^(b)`` where ``r_c^(b)`` bounds ``|k - k_hat|`` on
    channel ``c`` of block ``b`` (``sigma_c / 2`` for the affine codec, so with
    ``scaling = 1/sqrt(d)`` this is the paper's ``sum_c |q_c| sigma_c / (2 sqrt d)``).

    Args:
        q: ``[Hkv, G, d]`` queries grouped by kv head.
        channel_bound: ``[Hkv, n, d]``.
    Returns:
        ``[Hkv, G, n]`` FP32.
    """
    return scaling * torch.einsum("kgd,knd->kgn", q.abs().float(), channel_bound.float())


def mass_inflation(delta: torch.Tensor, exponent: float) -> torch.Tensor:
    """``e^{exponent * Delta}``: Theorem 4.4 uses exponent 2; the paper's implementation 3."""
    return torch.exp(exponent * delta)


def tail_mass_bound(
    log_alpha_hat: torch.Tensor, delta: torch.Tensor, exponent: float
) -> torch.Tensor:
    """True (FP16) tail mass bound ``min(1, e^{c Delta} alpha_hat)`` (eq. 14).

    Takes ``log alpha_hat`` so that a tail mass that underflows FP32 next to a huge ``Delta``
    (peaked attention, huge query norms) still yields a valid bound; ``-inf`` means no tail.
    """
    log_bound = (exponent * delta + log_alpha_hat).clamp(max=0.0)
    return torch.where(log_alpha_hat > float("-inf"), torch.exp(log_bound),
                       torch.zeros_like(log_bound))


def log_expm1(x: torch.Tensor) -> torch.Tensor:
    """``log(e^x - 1)`` for ``x >= 0`` without overflow (``-inf`` at 0)."""
    big = x > 20
    return torch.where(big, x + torch.log1p(-torch.exp(-x)),
                       torch.log(torch.expm1(torch.where(big, torch.zeros_like(x), x))))


def key_error_bound(
    v_max: torch.Tensor,
    delta: torch.Tensor,
    delta_tail: torch.Tensor,
    log_alpha_hat: torch.Tensor,
    exponent: float,
    cap_logit: torch.Tensor | None = None,
) -> torch.Tensor:
    """E_key (eq. 15): ``2 V_max TV``, ``TV <= min(tanh(Delta_T / 2), a_T (e^{2 Delta_T} - 1))``.

    * ``a_T = min(1, e^{c Delta} alpha_hat)`` bounds the true tail mass (Theorem 4.4, eq. 14);
      ``Delta`` is the max over every quantized block, ``c`` the mass-inflation exponent.
    * ``a_T (e^{2 Delta_T} - 1)`` is Lemma A.3, where ``Delta_T <= Delta`` is the max over the
      INT8 tail blocks, the only tokens whose Phase-2 logits are perturbed. It is evaluated in
      log space: ``a_T`` may underflow FP32 next to a huge ``e^{2 Delta_T}``.
    * ``tanh(Delta_T / 2)`` sharpens Lemma A.2 (``tanh Delta``): with ``S = {t: a'_t > a_t}`` and
      ``A = a(S)``, logit shifts of at most ``Delta_T`` give ``a'(S) <= A e^D / (A e^D +
      (1 - A) e^-D)``, so ``TV = a'(S) - A <= max_A (...) = tanh(Delta_T / 2)``.

    ``cap_logit`` (optional) is ``x`` of a second valid tail-mass bound ``sigmoid(x)`` (e.g.
    :func:`phase2_tail_logit`); the smaller bound is used.

    The minimum of valid bounds is valid and never looser than eq. 15. Every argument enters
    monotonically (a larger argument never gives a smaller bound), which
    :mod:`certkv.certify.arith` relies on. Returns 0 where nothing is left on INT8 keys.
    """
    log_tail = (exponent * delta + log_alpha_hat).clamp(max=0.0)  # -inf: no tail
    if cap_logit is not None:
        log_tail = torch.minimum(log_tail, torch.nn.functional.logsigmoid(cap_logit))
    no_tail = torch.isneginf(log_tail)
    log_a3 = torch.where(no_tail, log_tail, log_tail + log_expm1(2 * delta_tail))
    tv = torch.minimum(torch.tanh(delta_tail / 2), torch.exp(log_a3.clamp(max=0.0)))
    return 2 * v_max * tv


def phase2_tail_logit(
    l_int8: torch.Tensor,
    l_fp16: torch.Tensor,
    delta_b: torch.Tensor,
    promoted: torch.Tensor,
    tail: torch.Tensor,
) -> torch.Tensor:
    """True tail mass bound from Phase 2 as a logit: ``alpha_T <= sigmoid(log U_T - log Z_F)``.

    After Phase 2 the unnormalised FP16 mass of the promoted set, ``Z_F = sum_F e^{l16_b}``, is
    known exactly (the exact tail block included), and each INT8 tail block's FP16 mass is at
    most ``e^{l8_b + Delta_b}`` (eq. 8 per token), so ``Z_T <= U_T = sum_T e^{l8_b + Delta_b}``;
    ``x / (Z_F + x)`` grows with ``x``, hence ``alpha_T <= U_T / (Z_F + U_T)``. Unlike eq. 14
    this inflates only the tail, block by block, not the whole denominator by ``e^{2 Delta}``.
    Log-masses ``[Hq, n]`` -> ``[Hq]``; ``-inf`` without a tail, ``+inf`` with nothing promoted.
    """
    neg_inf = torch.full_like(l_int8, float("-inf"))
    log_u = torch.logsumexp(torch.where(tail, l_int8 + delta_b, neg_inf), dim=-1)
    log_z = torch.logsumexp(torch.where(promoted, l_fp16, neg_inf), dim=-1)
    return torch.where(torch.isneginf(log_u), log_u, log_u - log_z)


def phase2_tail_mass_bound(l_int8, l_fp16, delta_b, promoted, tail) -> torch.Tensor:
    """``U_T / (Z_F + U_T)`` per head ``[Hq]`` (:func:`phase2_tail_logit`)."""
    return torch.sigmoid(phase2_tail_logit(l_int8, l_fp16, delta_b, promoted, tail))


def value_error_bound(rho: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """E_val = ``sum_b rho_b * eta_b`` (Corollary 4.2); ``rho, eta: [..., n]`` -> ``[...]``."""
    return (rho * eta).sum(dim=-1)


def total_variation(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``TV(a, b) = 1/2 sum_t |a_t - b_t|`` over the last dimension (Theorem 4.3)."""
    return 0.5 * (a - b).abs().sum(dim=-1)
