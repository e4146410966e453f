"""The certificate segment of a quantized step and what a pass returns: pure tensor code, no
host read; compiled on GPU, replaced by numba loop nests on CPU (:mod:`certkv.certify.fused_cpu`,
which states the same numbers).

``policy`` is the step's components (``selector``, ``ladder``, ``mode``), as in
:mod:`certkv.certify.step_select`. Shapes: ``[Hq, n]`` per block, ``[Hq]`` per head, ``flags
[Hq + 2]`` (heads needing dense attention, then non-finite ``q`` and non-finite appended K/V).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from certkv.certify import fused_cpu
from certkv.certify.arith import (
    ArithSpec,
    dense_arith,
    logit_terms,
    quantized_arith,
    widened_blocks,
    widened_key_inputs,
)
from certkv.certify.bounds import (
    block_tv_bound,
    key_error_bound,
    logit_error_norms,
    tail_logit,
    value_error_bound,
    value_error_bound_tight,
)
from certkv.certify.certificate import BlockStats, Certificate
from certkv.certify.segment import CertifyInputs, CertifyOutputs
from certkv.certify.step_select import NEG_INF


def certify_step(policy, x: CertifyInputs, spec: ArithSpec, coef) -> CertifyOutputs:
    """The tight E_key (eq. 15 with the per-block TV bound and centred values) and E_val
    (Cor. 4.2 with the spectral block terms), E_arith of the quantized path
    (:mod:`certkv.certify.arith`), the paper's own terms (telemetry), the canary, the rungs and
    the flags the host reads.

    The key bound is evaluated once over three lanes: as returned, in the paper's form (eq. 8's
    ``Delta_b``, no per-block cap) and at the inputs widened by their rounding (arith item 2),
    the per-block TV bound once over the first and the last.

    ``x``: the named inputs (:class:`~certkv.certify.segment.CertifyInputs`, shapes there);
    ``spec, coef``: the arithmetic bound's static facts and step coefficients. Returns
    :class:`~certkv.certify.segment.CertifyOutputs`: ``returned`` (E_key and E_val ``[Hq]`` as
    returned: 0 on rungs 3-4) and, given ``x.v_max_kv``, the step's final ``e_arith`` after the
    device fallback (:func:`device_arith`; else None). A head whose output or bound is not
    finite, or whose output overflows the caller's dtype, goes dense (rung 3).
    """
    hq, n = x.l8.shape
    hkv = x.eta.shape[0]
    group = hq // hkv
    promoted, delta_b, delta_chan = x.promoted, x.delta_b, x.delta_chan
    not_tail = promoted | x.exact  # off the INT8 tail
    # log-sum-exps over blocks: the tail's INT8 upper log-masses with the tight and with eq. 8's
    # Delta_b (U_T), the promoted blocks' FP16 log-mass (Z_F), the tail's estimate
    lse = torch.logsumexp(torch.stack([x.l8 + delta_b, x.l8 + delta_chan, x.l16, x.log_p])
                          .masked_fill(torch.stack([not_tail, not_tail, ~promoted, not_tail]),
                                       NEG_INF), dim=-1)
    log_u, log_u_chan, log_z, log_alpha = lse.unbind()
    cap, cap_chan = tail_logit(torch.stack([log_u, log_u_chan]), log_z).unbind()
    d_tail = delta_b.masked_fill(not_tail, 0.0)
    delta_t, delta_t_chan, delta_chan_max = torch.stack(
        [d_tail, delta_chan.masked_fill(not_tail, 0.0), delta_chan]).amax(dim=-1)
    terms = logit_terms(spec, coef, x.q, x.key_abs_max, x.delta)
    # per-block TV bound (block_tv_bound) as returned and at the widened inputs, in FP64
    lam = logit_error_norms(x.q_norm, x.key_spec, spec.scaling).view(hq, n)
    rho64, spread64, d_tail64, lam64 = torch.stack([x.rho, x.spread, d_tail, lam]).double()
    widened = widened_blocks(coef, terms, rho64, spread64, delta_b.double(), lam64, not_tail)
    tv_block, tv_block_plus = block_tv_bound(*(torch.stack(pair) for pair in zip(
        (rho64, d_tail64, lam64, spread64), widened, strict=True))).unbind()
    # E_key (eq. 15 with both caps) in three lanes: returned, the paper's form (eq. 8's Delta_b,
    # no per-block cap; telemetry), and widened (arith item 2, without tanh(eps/2))
    wide = widened_key_inputs(terms, x.delta, delta_t, log_alpha, cap)
    e_key, paper_key, tv_plus = key_error_bound(
        torch.stack([x.v_rad, x.v_max, torch.full_like(x.v_max, 0.5)]),
        torch.stack([x.delta, delta_chan_max, wide[0]]),
        torch.stack([delta_t, delta_t_chan, wide[1]]),
        torch.stack([log_alpha, log_alpha, wide[2]]), policy.selector.mass_inflation,
        torch.stack([cap, cap_chan, wide[3]]),
        torch.stack([tv_block, torch.full_like(tv_block, math.inf), tv_block_plus]))
    # E_val (Cor. 4.2 per block, tight and the paper's) over the blocks read quantized
    eta_q = x.eta.masked_fill(x.value_kv, 0.0).unsqueeze(1)  # [Hkv, 1, n]
    sigma_kv = x.value_spec.masked_fill(x.value_kv, 0.0)
    rho3, spread3 = x.rho.view(hkv, group, n), x.spread.view(hkv, group, n)
    e_val = value_error_bound_tight(rho3, eta_q, spread3, sigma_kv.unsqueeze(1)).view(hq)
    paper_val = value_error_bound(rho3, eta_q).view(hq)
    e_key, paper_key = e_key.float(), paper_key.float()
    kv_of = x.kv_of
    e_arith = quantized_arith(
        coef, terms, tv_plus=tv_plus, v_max=x.v_max, v_rad=x.v_rad,
        eta_max=x.eta_max_kv[kv_of], sigma_max=sigma_kv.amax(dim=-1)[kv_of], e_key=e_key,
        e_val=e_val, out_norm=x.out.norm(dim=-1))
    value_blocks = x.value_kv.sum(dim=-1)[kv_of]
    canary, rung, flags = rungs(policy, x, e_key + e_val + e_arith, value_blocks)
    e_final = None if x.v_max_kv is None else device_arith(
        flags, e_arith, dense_arith(spec, 0, q=x.q, key_abs_max=x.key_abs_max,
                                    v_max=x.v_max_kv[kv_of], acc_coef=coef.dense_acc))
    return CertifyOutputs(e_key, e_val, e_arith, log_alpha.exp(),
                          (promoted & ~x.exact).sum(dim=-1), canary, rung, value_blocks, flags,
                          paper_key, paper_val, returned(rung, e_key, e_val), e_final)


def certify_fused(policy, x: CertifyInputs, spec: ArithSpec, coef) -> CertifyOutputs:
    """:func:`certify_step` with its arithmetic as one fused loop nest on CPU tensors
    (:func:`certkv.certify.fused_cpu.certificate`: same terms, same shapes, then the rungs, flags
    and returned bounds in one more, :func:`certkv.certify.fused_cpu.rungs`). Host fallback only
    (``x.v_max_kv`` None, ``e_final`` None)."""
    (e_key, e_val, e_arith, tail_mass, paper_key, paper_val, k_star, value_blocks, canary,
     rung, flags, returned_) = fused_cpu.certificate(
        spec, coef, policy.selector.mass_inflation, x, fused_cpu.RungInputs(
            policy.ladder, policy.mode == "certified", x.expanded, x.ranking, x.boundary,
            x.canary_blocks, x.kv_bad))
    return CertifyOutputs(e_key, e_val, e_arith, tail_mass, k_star, canary, rung, value_blocks,
                          flags, paper_key, paper_val, returned_, None)


def rungs(policy, x: CertifyInputs, bound, value_blocks):
    """The canary ``[Hq]``, each head's rung ``[Hq]`` and the flags ``[Hq + 2]``, from the
    pass's output, checks and canary in ``x``, the head's ``bound`` and its FP16 value blocks.
    A head whose output or ``bound`` is not finite (a NaN compares false), or whose output
    overflows the caller's dtype, goes dense (rung 3); ``torch.where``, not masked writes: no
    device sync."""
    certified, ladder, q = policy.mode == "certified", policy.ladder, x.q
    canary = ~x.canary_blocks.flatten(0, 1).any(dim=-1)
    if not (certified and ladder.canary):
        canary = torch.ones_like(canary)
    finite = (x.out.to(q.dtype).abs().amax(dim=-1) < math.inf) & (bound < math.inf)
    rung = torch.maximum(x.expanded.long(), (value_blocks > 0) * 2)
    rung = torch.where((x.ranking & x.boundary & finite) if certified else finite, rung, 3)
    if certified:
        rung = torch.where(ladder.layer_dense(rung >= 3, canary), 4, rung)
    bad = torch.stack([~(q.abs().amax() < math.inf), x.kv_bad])
    return canary, rung, torch.cat([rung >= 3, bad])


def returned(rung, e_key, e_val) -> tuple[torch.Tensor, torch.Tensor]:
    """E_key and E_val ``[Hq]`` as a head returns them: 0 on rungs 3-4 (dense heads)."""
    fast = rung < 3
    return torch.where(fast, e_key, 0.0), torch.where(fast, e_val, 0.0)


def device_arith(flags, e_arith, e_dense):
    """``[Hq]`` e_arith of a step whose fallback runs on the device (``flags [Hq + 2]``): the
    dense path's ``e_dense`` on flagged heads, ``inf`` everywhere when ``q`` or the appended K/V
    are not finite (an invalid certificate; arith item 7)."""
    hq = e_arith.shape[0]
    e_arith = torch.where(flags[:hq], e_dense, e_arith)
    return torch.where(flags[hq:].any(), math.inf, e_arith)


@dataclass
class StepPass:
    """What one pass of a quantized step computed: the FP32 output before the fallback, the
    certificate segment's outputs and what the certificate reports besides (``[Hq]``)."""

    out: torch.Tensor  # [Hq, d] FP32, before the fallback
    spec: ArithSpec
    cert: CertifyOutputs
    delta: torch.Tensor
    ranking: torch.Tensor
    boundary: torch.Tensor
    blocks: BlockStats
    num_blocks: int
    value_promotions: int | torch.Tensor = 0
    paged_evicted: int | torch.Tensor = 0
    # targeted page-in (:mod:`certkv.certify.targeted`): what a failed eq. 18 asks for (the
    # breaking blocks, their upper bounds, the kv heads' keys read), then what it bought
    mend: tuple | None = None
    targeted: int = 0  # new (kv head, block) pairs it read whole
    mended: int = 0  # heads whose boundary check held after it
    # a certificate computed in Phase 2's merge, whose rungs (``cert.rung``, ``flags``,
    # ``returned``, ``e_final``) the device fallback writes: (what the merge wrote, where)
    pending: tuple | None = None
    # what the pass read: FP16 keys ``[Hq, n]`` and FP16 values ``[Hkv, n]`` (the bound
    # tolerance's targeted page-in plans from them), or None
    read: tuple | None = None
    # a bound tolerance's blocks it read whole ``[Hq, n]`` (targeted page-in's mends aside),
    # or None, and how many new (kv head, block) pairs it planned ahead (Phase-1 masses)
    forced: torch.Tensor | None = None
    ahead: int = 0

    @property
    def flags(self) -> torch.Tensor:
        """``[Hq + 2]``: heads needing dense attention, then non-finite ``q`` and K/V."""
        return self.cert.flags

    @property
    def bound(self) -> torch.Tensor:
        """The bound a head would return on the quantized path."""
        c = self.cert
        return c.e_key + c.e_val + c.e_arith

    def at_least(self, floor: int, heads: torch.Tensor) -> None:
        """Raise ``heads`` (bool ``[Hq]``) to rung ``floor`` or above, with their returned
        bounds and flags (rungs 3-4 return no E_key, E_val); no device sync."""
        c = self.cert
        rung = torch.where(heads, c.rung.clamp(min=floor), c.rung)
        hq = rung.numel()
        flags = torch.cat([c.flags[:hq] | (rung >= 3), c.flags[hq:]])
        self.cert = c._replace(rung=rung, flags=flags, returned=returned(rung, c.e_key, c.e_val))

    def add_key_error(self, e_drop: torch.Tensor) -> None:
        """Naive eviction's dropped mass ``E_drop [Hq]`` joins the candidate and returned
        E_key."""
        c = self.cert
        e_key = c.e_key + e_drop
        self.cert = c._replace(e_key=e_key, returned=returned(c.rung, e_key, c.e_val))

    def certificate(self, e_arith: torch.Tensor, mode: str, boost) -> Certificate:
        """The step's certificate once the fallback chose ``e_arith`` (dense heads' own)."""
        c = self.cert
        e_key, e_val = c.returned
        if boost is None and self.pending is not None:  # zeros the fallback kernel wrote
            boost = self.pending[1].tol_level
        return Certificate(
            candidate_e_key=c.e_key, candidate_e_val=c.e_val, e_key=e_key, e_val=e_val,
            e_arith=e_arith, delta=self.delta, tail_mass=c.tail_mass, k_star=c.k_star,
            rung=c.rung, ranking_ok=self.ranking, boundary_ok=self.boundary,
            canary_ok=c.canary, value_blocks=c.value_blocks,
            value_promotions=self.value_promotions, num_blocks=self.num_blocks, mode=mode,
            paper_e_key=c.paper_key, paper_e_val=c.paper_val, tol_level=boost,
            blocks=self.blocks, paged_evicted=self.paged_evicted, targeted=self.targeted,
            mended=self.mended)
