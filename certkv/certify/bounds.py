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
    return torch.bmm(q.abs().float(), channel_bound.float().transpose(1, 2)) * scaling


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
    return torch.where(log_alpha_hat > float("-inf"), torch.exp(log_bound), 0.0)


def log_expm1(x: torch.Tensor) -> torch.Tensor:
    """``log(e^x - 1) = x + log(1 - e^{-x})`` for ``x >= 0``, accurate at both ends and without
    overflow (``-inf`` at 0, ``+inf`` at ``+inf``)."""
    return x + torch.log(-torch.expm1(-x))


def key_error_bound(
    v_max: torch.Tensor,
    delta: torch.Tensor,
    delta_tail: torch.Tensor,
    log_alpha_hat: torch.Tensor,
    exponent: float,
    cap_logit: torch.Tensor | None = None,
    tv_cap: torch.Tensor | None = None,
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
    :func:`phase2_tail_logit`); the smaller bound is used. ``tv_cap`` (optional) is a second
    valid bound on ``TV`` itself (e.g. :func:`block_tv_bound`); the smaller is used.

    ``v_max`` may be any ``R >= max_t ||v_t - c||`` for a fixed vector ``c``
    (:func:`centred_radius`): both distributions sum to one, so
    ``sum_t (a'_t - a_t) v_t = sum_t (a'_t - a_t)(v_t - c)`` and Theorem 4.3's proof goes through
    with ``R`` in place of ``V_max`` (``c = 0`` is the paper's form).

    The minimum of valid bounds is valid and never looser than eq. 15. Every argument enters
    monotonically (a larger argument never gives a smaller bound), which
    :mod:`certkv.certify.arith` relies on. Returns 0 where nothing is left on INT8 keys.
    """
    log_tail = (exponent * delta + log_alpha_hat).clamp(max=0.0)  # -inf: no tail
    if cap_logit is not None:
        log_tail = torch.minimum(log_tail, torch.nn.functional.logsigmoid(cap_logit))
    log_a3 = log_tail + log_expm1(2 * delta_tail)  # NaN only for -inf + inf: no tail
    log_a3 = torch.where(torch.isneginf(log_tail), log_tail, log_a3)
    tv = torch.minimum(torch.tanh(delta_tail / 2), torch.exp(log_a3.clamp(max=0.0)))
    if tv_cap is not None:
        tv = torch.minimum(tv, tv_cap.to(tv.dtype))
    return 2 * v_max * tv


def centred_radius(v: torch.Tensor, centre: torch.Tensor) -> torch.Tensor:
    """``max_t ||v_t - c||_2`` over a block's tokens, FP64 (the centred ``V_max`` of
    :func:`key_error_bound`): ``v [..., B, d]``, ``centre [..., d]`` (broadcast) -> ``[...]``."""
    return (v.double() - centre.double().unsqueeze(-2)).norm(dim=-1).amax(dim=-1)


# cuSOLVER's batched symmetric eigensolver fails (CUSOLVER_STATUS_INTERNAL_ERROR or
# INVALID_VALUE) on batches of more than about 32K matrices: 8 kv heads x 4096 blocks, a 64K
# prompt at B = 16. Each matrix is solved on its own, so chunks give the same eigenvalues.
EIGH_BATCH = 16384


def _largest_eigenvalues(gram: torch.Tensor) -> torch.Tensor:
    """``lambda_max`` of symmetric matrices ``gram [..., m, m]`` -> ``[...]``, in chunks of at
    most :data:`EIGH_BATCH` matrices."""
    flat = gram.reshape(-1, *gram.shape[-2:])
    tops = [torch.linalg.eigvalsh(chunk)[:, -1] for chunk in flat.split(EIGH_BATCH)]
    return torch.cat(tops).reshape(gram.shape[:-2])


def spectral_norm_upper(err: torch.Tensor) -> torch.Tensor:
    """Upper bound on the spectral norm ``||E||_2`` of error matrices ``E [..., B, d]`` -> FP64
    ``[...]`` (one per block and kv head; measured at write time).

    ``||E||_2^2 = lambda_max(G)`` for the Gram matrix ``G = E E^T`` (or ``E^T E``, the smaller
    one), formed in FP64 and handed to a symmetric eigensolver. Forming ``G`` errs by at most
    ``gamma_d ||E||_F^2`` and a backward-stable eigensolver moves ``lambda_max`` by at most
    ``p(B) u ||G||_2 <= p(B) u ||E||_F^2`` (``u = 2^-53``, ``p`` a low-degree polynomial), both
    far below the slack ``1e-12 ||E||_F^2`` added under the root. ``||E||_2 <= ||E||_F`` always,
    so the smaller of the two is returned (both within a few FP64 ulps of an upper bound: the
    store inflates stored annotations by ``1e-12`` relative before rounding them up to FP32).
    """
    e = err.double()
    frob2 = e.square().sum(dim=(-2, -1))
    if e.numel() == 0:
        return frob2.sqrt()
    finite = torch.isfinite(e).all(dim=-1).all(dim=-1)  # non-finite data: +inf, not an error
    e = torch.where(torch.isfinite(e), e, 0.0)
    rows, cols = e.shape[-2:]
    gram = e @ e.transpose(-1, -2) if rows <= cols else e.transpose(-1, -2) @ e
    top = _largest_eigenvalues(gram).clamp_min(0.0)
    upper = torch.minimum(torch.sqrt(top + 1e-12 * frob2), frob2.sqrt())
    return torch.where(finite, upper, float("inf"))


def value_block_terms(rho: torch.Tensor, eta: torch.Tensor, spread: torch.Tensor | None = None,
                      sigma: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block value-error contributions ``[..., n]`` (Cor. 4.2, sharpened):
    ``||sum_{t in b} p_t e_t||_2 <= min(rho_b eta_b, s_b ||p_b||_2)``.

    ``e_t = v_hat_t - v_t``; ``E_b [B, d]`` stacks a block's ``e_t``; ``p_b [B]`` its tokens'
    weights. Triangle inequality: ``||E_b^T p_b|| <= sum_t p_t ||e_t|| <= rho_b eta_b``
    (``rho_b = sum p_t``, ``eta_b = max ||e_t||``). Operator norm: ``||E_b^T p_b|| <=
    ||E_b||_2 ||p_b||_2 = s_b ||p_b||_2``, which is smaller when the weight spreads over the
    block (``||p_b||_2 = rho_b / sqrt(B)`` for uniform weights) and the errors are not aligned
    (``s_b`` ~ ``eta_b (1 + sqrt(d / B))`` for random errors, ``sqrt(B) eta_b`` at worst).

    Args: ``rho, eta, spread = ||p_b||_2, sigma = s_b``, all ``[..., n]`` (spread/sigma None:
    the paper's ``rho_b eta_b``).
    """
    terms = rho * eta
    if spread is None or sigma is None:
        return terms
    return torch.minimum(terms, spread * sigma)


def value_error_bound_tight(rho, eta, spread=None, sigma=None) -> torch.Tensor:
    """E_val ``= sum_b min(rho_b eta_b, s_b ||p_b||_2)`` (:func:`value_block_terms`) ->
    ``[...]``: the triangle inequality over blocks, each block bounded as tightly as known."""
    return value_block_terms(rho, eta, spread, sigma).sum(dim=-1)


def logit_error_norms(q_norm: torch.Tensor, key_spec: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """``lambda_b``: ``||x_b||_2 <= scaling ||q|| s^K_b`` bounds the l2 norm over block ``b``'s
    tokens of the logit errors ``x_t = scaling q . (k_hat_t - k_t)`` (``x_b = scaling E^K_b q``,
    ``s^K_b = ||E^K_b||_2`` the key-error spectral norm). ``q_norm [Hkv, G]``,
    ``key_spec [Hkv, n]`` -> ``[Hkv, G, n]``."""
    return scaling * q_norm.unsqueeze(-1) * key_spec.unsqueeze(1)


def tightened_deltas(delta_b: torch.Tensor, q_norm: torch.Tensor, key_err: torch.Tensor,
                     scaling: float) -> torch.Tensor:
    """Per-block max logit error ``min(Delta_b, scaling ||q|| max_t ||k_t - k_hat_t||)`` (eq. 8
    and Cauchy-Schwarz per token): both bound ``|scaling q . (k_t - k_hat_t)|`` for every token
    of the block, so their minimum does. ``delta_b [Hkv, G, n]`` (eq. 8's channel form),
    ``q_norm [Hkv, G]``, ``key_err [Hkv, n]`` (0 on the exact tail block) -> ``[Hkv, G, n]``."""
    return torch.minimum(delta_b, scaling * q_norm.unsqueeze(-1) * key_err.unsqueeze(1))


def block_tv_bound(rho: torch.Tensor, delta_b: torch.Tensor, lam: torch.Tensor | None = None,
                   spread: torch.Tensor | None = None) -> torch.Tensor:
    """Per-block bound on ``TV(p, p')`` from the *perturbed* distribution's block masses.

    ``p = softmax(s)`` (exact logits), ``p' = softmax(s')`` (the logits the step used), ``y_t =
    s'_t - s_t`` with ``|y_t| <= D_b`` on block ``b`` (``D_b = 0`` where keys are exact) and
    ``||y_b||_2 <= lambda_b``. Then ``p_t = p'_t e^{-y_t} / W`` with ``W = sum_t p'_t e^{-y_t}``
    and ``sum_t |p_t - p'_t| = (1/W) sum_t p'_t |e^{-y_t} - W| <= (1/W) (sum_t p'_t
    |e^{-y_t} - 1| + |1 - W|) <= (2/W) sum_t p'_t |e^{-y_t} - 1|`` (as ``|1 - W| = |sum_t p'_t
    (e^{-y_t} - 1)|``). Hence, with ``phi(D) = (e^D - 1) / D`` (``|e^{-y} - 1| <= phi(D) |y|``
    for ``|y| <= D``, by convexity of ``e^x``), ``rho'_b = p'(b)`` and Cauchy-Schwarz
    ``sum_{t in b} p'_t |y_t| <= min(rho'_b D_b, ||p'_b||_2 lambda_b)``::

        TV <= sum_b phi(D_b) min(rho'_b D_b, ||p'_b||_2 lambda_b) / W,
        W >= max(1 - sum_b rho'_b (1 - e^{-D_b}), e^{-max_b D_b}) > 0

    (``W >= sum_b rho'_b e^{-D_b}`` = the first form, and every ``e^{-y_t} >= e^{-max D}``
    gives the second, so the denominator is positive for finite ``D``; where it is not, or the
    result exceeds 1, ``TV <= 1`` is returned). First-order tight: for small one-signed ``y`` on
    a small tail, ``TV = sum_t p_t |y_t| + O(y^2 + alpha_T y)``. Against Lemma A.3
    (``a_T (e^{2 Delta_T} - 1) ~ 2 Delta_T a_T``) it saves the factor 2, weights each block by
    its own ``D_b`` and uses ``p'``'s block masses directly (no ``e^{c Delta}`` inflation).

    Monotone in every argument (larger ``rho, D, lambda, spread`` never give a smaller bound),
    so upper bounds of them may be passed (:mod:`certkv.certify.arith`).

    Args: ``rho, delta_b [..., n]`` (``D_b``); ``lam, spread [..., n]`` or None -> ``[...]``.
    """
    d = delta_b
    finfo = torch.finfo(d.dtype)
    # phi on D clamped to [tiny, max]: phi(0) = 1 and phi(inf) = inf (e^D - 1 overflows
    # first), never 0/0 or inf/inf
    dc = d.clamp(finfo.tiny, finfo.max)
    phi = torch.expm1(dc) / dc
    per = rho * d  # NaN for a massless block at D = inf: dropped below
    if lam is not None and spread is not None:
        per = torch.minimum(per, spread * lam)
    num = torch.where(per > 0, phi * per, 0.0).sum(dim=-1)  # a massless block adds nothing
    kept = 1.0 + (rho * torch.expm1(-d)).sum(dim=-1)  # 1 - sum_b rho_b (1 - e^{-D_b})
    den = torch.maximum(kept, torch.exp(-d.amax(dim=-1)))
    tv = num / den.clamp_min(finfo.tiny)
    return tv.clamp(max=1.0).nan_to_num(nan=1.0)


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
    log_u = torch.logsumexp(torch.where(tail, l_int8 + delta_b, float("-inf")), dim=-1)
    log_z = torch.logsumexp(torch.where(promoted, l_fp16, float("-inf")), dim=-1)
    return tail_logit(log_u, log_z)


def tail_logit(log_u: torch.Tensor, log_z: torch.Tensor) -> torch.Tensor:
    """``log U_T - log Z_F`` of :func:`phase2_tail_logit` from the two log-sum-exps (any
    matching shapes); ``-inf`` where there is no tail (``log U_T = -inf``)."""
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
