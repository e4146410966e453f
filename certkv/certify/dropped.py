"""E_drop: what dropping blocks from attention costs a head, bounded at run time (issue 23).

Naive eviction (what kvpress and every eviction policy do) attends over the kept blocks ``K``
only. Against ``O_ref``, attention in exact arithmetic on every original token, the triangle
inequality splits the error in two:

    ``||O_hat - O_ref|| <= ||O_hat - O_K|| + ||O_K - O_ref||``,

``O_K`` being exact attention over ``K``'s originals. The first term is the certificate of a
step over ``K`` alone (the store with the dropped blocks masked out of Phase 1: zero mass, no
``Delta_b``). For the second, with ``m_D`` the exact attention mass of the dropped blocks ``D``,
``O_ref = (1 - m_D) O_K + m_D O_D``, so ``||O_K - O_ref|| = m_D ||O_K - O_D|| <= 2 R m_D``:
both are convex combinations of original values, within ``R = max_t ||v_t - c||`` of the
centre ``c`` (the radius E_key uses). And ``m_D = Z_D / (Z_K + Z_D) <= U_D / (L_K + U_D)`` for
any ``U_D >= Z_D`` and ``L_K <= Z_K`` (``x / (a + x)`` grows with ``x`` and falls with ``a``).

Both come from Phase 1, which scored every block (the dropped ones from what Tier-1 still
holds: an evicted block's summary, :mod:`certkv.quant.summary`). With ``l_b`` a block's computed
log-mass, ``Delta_b`` its computed eq.-8 bound, ``eps`` the logit rounding of
:func:`~certkv.certify.arith.logit_rounding` (every computed logit within ``eps`` of the exact
logit of the key it used, and the exact ``Delta_b`` within ``eps`` above the computed one) and
``kappa_b`` the rounding of the block's log-sum-exp (:mod:`certkv.certify.arith` item 5), every
exact block log-mass lies within ``Delta_b + 2 eps + kappa_b`` of ``l_b``::

    log U_D = lse_{b in D} (l_b + Delta_b + 2 eps + kappa_b),
    log L_K = lse_{b in K} (l_b - Delta_b - 2 eps - kappa_b)     (Delta_b = 0 on exact blocks).

These run in FP64 (their own rounding, ``2^-50`` relative and a log-sum-exp's ``gamma``, is
added outward), and ``E_drop = 2 R sigmoid(log U_D - log L_K)`` is rounded up to FP32. It joins
``E_key`` (it is a key-side error: which tokens are attended), so the returned bound
``e_key + e_val + e_arith`` covers the dropped tokens with no allowance elsewhere.
"""

from __future__ import annotations

import torch

from certkv.certify.arith import (
    U32,
    ArithSpec,
    _lse_rounding,
    _round_up_fp32,
    logit_magnitude,
    logit_rounding,
)

U64 = 2.0**-53


def _lse64(x: torch.Tensor, mask: torch.Tensor, outward: float) -> torch.Tensor:
    """FP64 log-sum-exp ``[Hq]`` of ``x [Hq, n]`` where ``mask``, moved ``outward`` (+1 up,
    -1 down) by more than its own rounding; ``-inf`` where the mask is empty."""
    terms = int(mask.shape[-1])
    lse = torch.logsumexp(torch.where(mask, x, float("-inf")), dim=-1)
    slack = _lse_rounding(terms, terms, U64) + 4 * U64 * lse.abs()
    return torch.where(torch.isfinite(lse), lse + outward * slack, lse)


def dropped_mass(spec: ArithSpec, *, q: torch.Tensor, key_abs_max: torch.Tensor,
                 l8: torch.Tensor, delta_b: torch.Tensor, dropped: torch.Tensor,
                 n_tokens: int) -> torch.Tensor:
    """Upper bound ``[Hq]`` (FP64) of the exact attention mass of the ``dropped`` blocks.

    Args:
        spec: the step's :class:`~certkv.certify.arith.ArithSpec` (Phase 1's rounding chain).
        q: ``[Hq, d]`` in the caller's dtype; key_abs_max: ``[Hkv, d]`` (arith item 1's ``K_c``).
        l8: ``[Hq, n]`` Phase-1 block log-masses as computed (every block, dropped ones too).
        delta_b: ``[Hq, n]`` Phase-1 ``Delta_b`` as computed (eq. 8; 0 on exact blocks).
        dropped: bool ``[n]``, the blocks left out of the step (the rest are kept).
        n_tokens: tokens in the store (the rounding chain's ``N``).
    """
    d = spec.head_dim
    l8, delta_b = l8.double(), delta_b.double()
    magnitude = logit_magnitude(q, key_abs_max, spec.scaling)
    delta = delta_b.amax(dim=-1)
    eps = logit_rounding(spec.rounding.logit_gamma(d), magnitude, delta, spec.scaling,
                         d).unsqueeze(-1)
    kappa = _lse_rounding(spec.block_size, n_tokens, U32) + 8 * U32 * (l8.abs() + 1)
    slack = delta_b + 2 * eps + kappa
    log_u = _lse64(l8 + slack, dropped, +1.0)
    log_l = _lse64(l8 - slack, ~dropped, -1.0)
    mass = torch.sigmoid(log_u - log_l) * (1 + 8 * U64)
    return torch.where(torch.isneginf(log_u), 0.0, mass).clamp(max=1.0)


def dropped_error(mass: torch.Tensor, v_rad: torch.Tensor) -> torch.Tensor:
    """``E_drop = 2 R m_D`` ``[Hq]``, FP32 rounded up: ``mass`` from :func:`dropped_mass`,
    ``v_rad`` the centred radius ``R`` (``[Hq]``, never above ``V_max``)."""
    return _round_up_fp32(2 * v_rad.double() * mass * (1 + 4 * U64))
