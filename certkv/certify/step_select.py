"""The selection segment of a quantized step (paper Section 3.3): pure tensor code, no host
read; compiled on GPU, replaced by one numba loop nest on CPU (:mod:`certkv.certify.fused_select`,
which states the same numbers).

``policy`` is the step's components: any object with ``selector`` (the FP16-key set),
``value_policy`` (the FP16-value blocks), ``ladder`` (rung 1 and the exploration) and ``mode``
(``"certified"`` or ``"naive"``), in practice the :class:`~certkv.attention.CertifiedAttention`
itself, so that a compiled segment guards on the same objects a user configured.

Shapes: ``[Hq, n]`` per block and query head, ``[Hq]`` per head, ``[Hkv, n]`` per kv head, the
``n`` blocks being the quantized ones then, if present, the exact FP16 tail block.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from certkv.certify.bounds import (
    block_tv_bound,
    key_error_bound,
    tail_mass_bound,
    tightened_deltas,
)
from certkv.certify.checks import exploration_mask
from certkv.certify.segment import SelectInputs, Selection

NEG_INF = float("-inf")


class KeySetInputs(NamedTuple):
    """What rung 1's key set reads (``[Hq, n]`` unless noted)."""

    log_p: torch.Tensor  # estimated log-masses (Phase 1)
    quantized: torch.Tensor  # [n] blocks read from INT8 keys unless promoted
    exact: torch.Tensor  # [n] blocks always read exactly (exact windows, the tail block)
    n_q: int | torch.Tensor  # quantized block count (a 0-d tensor on the device path)
    delta_b: torch.Tensor  # tightened logit bounds
    delta: torch.Tensor  # [Hq] their maximum
    delta_chan: torch.Tensor  # eq. 8's per-channel Delta_b (the paper's tail mass)
    v_max: torch.Tensor  # [Hq] value norm maxima
    v_rad: torch.Tensor  # [Hq] centred value radii
    group: int  # query heads per kv head


def select_step(policy, x: SelectInputs) -> Selection:
    """Paper 3.3's key set with rung 1, the value promotions (rung 2) and the page-in plan.

    ``x``: :class:`~certkv.certify.segment.SelectInputs` (``boost [Hq]``: bound-tolerance
    escalation level, 1: key set at the ladder's cap, 2: also FP16 values of the promoted
    blocks). Returns :class:`~certkv.certify.segment.Selection` (``delta_b`` tightened,
    :func:`~certkv.certify.bounds.tightened_deltas`; the plan: FP16 keys needed by any head of
    the kv head, FP16 values; ``exact = ~quantized``: exact windows and the tail block).
    """
    hkv, group, n = x.l8_kv.shape
    hq = hkv * group
    exact = ~x.quantized
    l8 = x.l8_kv.reshape(hq, n)
    log_p = torch.log_softmax(l8, dim=-1)
    q_norm = torch.linalg.vector_norm(x.qg, dim=-1)
    delta_chan = x.delta_kv.reshape(hq, n)  # 0 on the exact tail block
    delta_b = tightened_deltas(x.delta_kv, q_norm, x.key_err, x.scaling).reshape(hq, n)
    delta = delta_b.amax(dim=-1)
    v_max, v_rad = torch.stack([x.v_max_kv, torch.minimum(x.v_rad_kv, x.v_max_kv)])[:, x.kv_of]
    certified = policy.mode == "certified"
    keys = KeySetInputs(log_p, x.quantized, exact, x.n_q, delta_b, delta, delta_chan, v_max,
                        v_rad, group)
    promoted, expanded = key_set(policy, keys, x.draw, x.boost, x.force) if certified else (
        exact.expand(hq, -1), torch.zeros(hq, dtype=torch.bool, device=exact.device))
    log_spread = x.log_spread_kv.reshape(hq, n) - (l8 - log_p)  # minus each head's log-sum-exp
    shift = torch.where(promoted, delta_b, torch.zeros_like(delta_b))  # Phase 2's logit moves
    value_kv = value_promotion(policy, log_p, x.eta, shift, log_spread, x.value_spec) \
        if certified else torch.zeros_like(x.eta, dtype=torch.bool)
    if x.boost is not None:  # level 2: FP16 values for the boosted heads' promoted blocks
        extra = promoted & x.quantized & (x.boost >= 2).unsqueeze(-1)
        value_kv = value_kv | (extra.reshape(hkv, group, n).any(dim=1) & (x.eta > 0))
    if x.force is not None:  # targeted page-in reads its blocks whole: FP16 values too
        value_kv = value_kv | forced_values(x.force, x.eta)
    need_keys = promoted.view(hkv, group, n).any(dim=1) & x.quantized
    return Selection(log_p, delta_b, delta, delta_chan, v_max, v_rad, q_norm, promoted,
                     expanded, value_kv, torch.stack([need_keys, value_kv]), exact)


def forced_values(force: torch.Tensor, eta: torch.Tensor) -> torch.Tensor:
    """``[Hkv, n]``: the blocks whose FP16 values targeted page-in reads (``force [Hq, n]``:
    blocks read whole), where any query head of the kv head forces one with lossy values
    (``eta [Hkv, n] > 0``)."""
    hkv, n = eta.shape
    return force.view(hkv, -1, n).any(dim=1) & (eta > 0)


def key_set(policy, x: KeySetInputs, draw, boost=None, force=None):
    """FP16-key set ``[Hq, n]`` (exact blocks always in) and the rung-1 flag ``[Hq]``: the
    selector's top-k, widened by the ladder where the tail mass (eq. 14) or the candidate E_key
    asks for it, at the ladder's cap for heads the bound tolerance boosted (``boost [Hq]``),
    plus the exploration ``draw`` and the blocks targeted page-in asks for (``force [Hq, n]``,
    :mod:`certkv.certify.targeted`)."""
    sel, ladder = policy.selector, policy.ladder
    p = x.log_p.exp()
    order = sel.order(p, x.delta_b, x.quantized)
    rank = sel.ranks(order)
    k = sel.choose_k(p, x.quantized, order, x.n_q)
    promoted = sel.promoted(rank, k, x.exact, x.group)
    tail = paper_tail if ladder.tail_mass == "paper" else tight_tail
    tail_bound, e_key = tail(policy, x, promoted)
    need = ladder.needs_expansion(tail_bound, sel.tau_cov, e_key)
    k_new = torch.where(need, ladder.expanded_k(k, sel.k_max, x.n_q), k)
    if boost is not None:  # bound-tolerance escalation: the widest key set the ladder allows
        cap = ladder.key_cap(sel.k_max, x.n_q)
        k_new = torch.where(boost >= 1, k_new.clamp(min=cap), k_new)
    expanded = k_new > k
    promoted = sel.promoted(rank, k_new, x.exact, x.group)  # all tensor ops, no host sync
    if force is not None:
        promoted = promoted | force
    if draw is not None:
        promoted = promoted | exploration_mask(x.quantized & ~promoted, draw, ladder.exploration)
    return promoted, expanded


def paper_tail(policy, x: KeySetInputs, promoted):
    """Rung 1's tail mass as in the paper, eq. 14's ``e^{c Delta} alpha_hat`` with eq. 8's
    channel ``Delta_b``, and the candidate E_key (eq. 15) when ``ladder.e_key_tol`` asks for it,
    else None (``[Hq]`` each). Exact blocks are among the ``promoted``."""
    c = policy.selector.mass_inflation
    delta = x.delta_chan.amax(dim=-1)
    if policy.ladder.e_key_tol is None:
        log_alpha = torch.logsumexp(x.log_p.masked_fill(promoted, NEG_INF), dim=-1)
        return tail_mass_bound(log_alpha, delta, c), None
    log_alpha, e_key = key_bound(x.log_p, ~promoted, x.delta_chan, delta, x.v_max, c)
    return tail_mass_bound(log_alpha, delta, c), e_key


def tight_tail(policy, x: KeySetInputs, promoted):
    """Rung 1's tail mass, tight, and the candidate E_key when ``ladder.e_key_tol`` asks for
    it, else None (``[Hq]`` each). Exact blocks are among the ``promoted``.

    Phase 2 changes only the promoted blocks' logits, each by at most its ``Delta_b``, so with
    ``Delta_F`` the largest of them its tail mass is at most ``min(1, e^{Delta_F} alpha_hat)``
    and each tail block's mass at most ``min(1, e^{Delta_F} p_hat_b)`` (``Z_F' >= e^{-Delta_F}
    Z_F``); E_key is then the per-block TV bound with those masses
    (:func:`~certkv.certify.bounds.block_tv_bound`) and the centred radius.
    """
    not_promoted = ~promoted
    delta_f = x.delta_b.masked_fill(not_promoted, 0.0).amax(dim=-1)  # 0 on exact blocks
    log_alpha = torch.logsumexp(x.log_p.masked_fill(promoted, NEG_INF), dim=-1)
    # min(1, e^{Delta_F} alpha_hat); NaN (not above any threshold) only for inf - inf, where
    # no tail is left: like 0, never expands
    bound = torch.exp((delta_f + log_alpha).clamp(max=0.0))
    if policy.ladder.e_key_tol is None:
        return bound, None
    tail = x.quantized & not_promoted
    rho_ub = torch.exp((delta_f.unsqueeze(-1) + x.log_p).clamp(max=0.0))
    tv = block_tv_bound(torch.where(tail, rho_ub, 0.0), torch.where(tail, x.delta_b, 0.0))
    _, e_key = key_bound(x.log_p, tail, x.delta_b, x.delta, x.v_rad,
                         policy.selector.mass_inflation, tv_cap=tv)
    return bound, e_key


def key_bound(log_p, tail, delta_b, delta, v_max, exponent, tv_cap=None):
    """``(log alpha_hat, E_key)``, each ``[Hq]``, for INT8 tail blocks ``tail [Hq, n]``
    (eq. 15); ``tv_cap`` gives a valid bound on TV itself (the per-block bound)."""
    log_alpha = torch.logsumexp(torch.where(tail, log_p, NEG_INF), dim=-1)
    delta_tail = torch.where(tail, delta_b, 0.0).amax(dim=-1)
    return log_alpha, key_error_bound(v_max, delta, delta_tail, log_alpha, exponent, None,
                                      tv_cap)


def value_promotion(policy, log_p, eta, shift, log_spread, value_spec):
    """Blocks read with FP16 values, per kv head ``[Hkv, n]`` (the union of its query heads'):
    the value policy sees ``[Hkv, G, n]`` views (``shift [Hq, n]``: how far Phase 2 may move
    each block's logits from Phase 1's, :func:`~certkv.certify.values.phase2_mass_factor`), the
    per-kv-head ``eta`` and ``value_spec`` broadcast over the group; only blocks with a value
    error (``eta > 0``: quantized ones) can be promoted."""
    hkv = eta.shape[0]
    hq, n = log_p.shape
    grouped = (hkv, hq // hkv, n)
    eta_g = eta.unsqueeze(1)
    chosen = policy.value_policy.select(log_p.view(grouped), eta_g, shift.view(grouped),
                                        log_spread=log_spread.view(grouped),
                                        sigma=value_spec.unsqueeze(1))
    return (chosen & (eta_g > 0)).any(dim=1)
