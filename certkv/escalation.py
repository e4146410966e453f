"""The passes of a quantized step beyond the first (paper 3.4's ladder, and issue 56's targeted
page-in): where a head's boundary check (eq. 18) fails on a store with evicted blocks, a pass
that also reads the blocks that broke it (``ladder.page_in_budget``); and with a bound tolerance
(``ladder.bound_tol`` / ``bound_rtol``), passes for the heads whose returned bound exceeds it:
with ``ladder.tol_page_in`` first one that reads the fewest blocks carrying their bound
(:func:`~certkv.certify.targeted.tolerance_plan`), then the widest key set, then FP16 values
for it, then dense attention.

:class:`Escalation` is a base of :class:`~certkv.step.QuantizedStep`, whose ``_pass`` (one pass
of selection, page-in, Phase 2, checks and certificate over Phase 1's scores, with what a
failed boundary check asks to read) and ``_host_flags`` it calls; ``_pass`` asks
:meth:`Escalation._tolerance_ahead` what a tolerant step's first pass reads besides its
selection. A pass only chooses what is read: each computes its certificate afresh, so no
escalation can weaken one.
"""

from __future__ import annotations

import math

import torch

from certkv.certify import targeted
from certkv.certify.certificate import BlockStats
from certkv.certify.step_certify import StepPass

TOL_LEVELS = 3  # bound-tolerance escalation: 1 widest key set, 2 + FP16 values, 3 dense


class Escalation:
    """The escalating passes of a step (see the module)."""

    def _passes(self, step, scored, e_drop, tolerant):
        """The passes over Phase 1's scores: one, or with a bound tolerance (``tolerant``) up
        to :data:`TOL_LEVELS` escalations of the heads over it (1: the widest key set, 2: also
        FP16 values, 3: dense), after one targeted pass where ``ladder.tol_page_in`` asks for
        it. Returns ``(StepPass, boost [Hq] or None, dense heads)`` (host indices of the heads
        for the host fallback; None on the device path)."""
        boost, force, q = None, None, step.q
        targeted_first, passes, pairs = tolerant and self.ladder.tol_page_in, 0, 0
        # with an absolute tolerance the first pass plans ahead too (_tolerance_ahead)
        ahead = targeted_first and not step.on_device and self.ladder.bound_tol is not None
        while True:
            result = self._mended_pass(step, scored, boost, force, ahead)
            ahead = False
            result.targeted += pairs
            if e_drop is not None:  # summaries corrupted by faults: no finite E_drop, dense
                result.at_least(3, ~(e_drop < math.inf))
            if step.on_device:  # never tolerant: one pass
                return result, boost, None
            norm = result.out.norm(dim=-1) if tolerant else None
            over = self.ladder.over_tolerance(result.bound, norm) if tolerant else None
            dense_heads, over_heads = self._host_flags(result.flags, over)
            if over_heads.numel() == 0:
                return result, boost, dense_heads
            if targeted_first:  # once: the blocks that carry the bound, before wider sets
                targeted_first = False
                limit = (self.ladder.tolerance(norm) - result.cert.e_arith.double()) / 2
                plan, pairs = targeted.tolerance_plan(result.blocks, result.read, over, limit)
                if bool(plan.any()):  # with what the pass planned ahead, read again
                    force = plan if result.forced is None else result.forced | plan
                    pairs += result.ahead
                    continue
            boost = (torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
                     if boost is None else boost)
            boost = torch.where(over, torch.clamp(boost + 1, max=TOL_LEVELS), boost)
            passes += 1
            if passes == TOL_LEVELS:
                break
        # still over after the widest pass: dense
        over = torch.zeros(q.shape[0], dtype=torch.bool, device=q.device)
        over[over_heads.to(q.device, non_blocking=True)] = True
        boost[over] = TOL_LEVELS
        result.at_least(3, over)
        return result, boost, torch.unique(torch.cat([dense_heads, over_heads]))

    def _mended_pass(self, step, scored, boost, force=None, ahead=False) -> StepPass:
        """A pass (reading ``force [Hq, n]``'s blocks whole, where given; with ``ahead`` also
        the blocks a bound tolerance plans from Phase 1, :meth:`_tolerance_ahead`), and where
        its boundary check (eq. 18) failed on a store with evicted blocks, a second pass that
        also reads the blocks that broke it (FP16 keys, and values where lossy), within
        ``ladder.page_in_budget`` (:mod:`certkv.certify.targeted`); what it read and mended
        goes into the certificate."""
        first = self._pass(step, scored, boost, force, ahead=ahead)
        if first.mend is None:
            return first
        mend, pairs = targeted.plan(*first.mend, self.ladder.page_in_budget)
        force = first.forced  # what the first pass read whole (planned ahead included)
        result = self._pass(step, scored, boost, mend if force is None else mend | force,
                            mendable=False)
        result.mend, result.targeted = None, pairs + first.targeted
        result.forced, result.ahead = force, first.ahead  # the mends: made again if needed
        result.mended = int((result.boundary & ~first.boundary).sum())
        return result

    def _tolerance_ahead(self, lay, sel):
        """The blocks a tolerant step's first pass reads whole besides its selection (where
        :meth:`_passes` asks: ``ladder.tol_page_in`` with an absolute ``bound_tol``, on the
        host path): per head, the fewest whose shares of its bound, estimated from the Phase-1
        masses, leave the rest within half of ``bound_tol``
        (:func:`~certkv.certify.targeted.tolerance_plan`, which the second pass plans from the
        Phase-2 masses), so that most heads reach their tolerance in one pass. ``(plan [Hq,
        n], new pairs)``, or ``(None, 0)`` where nothing is planned. The pass certifies afresh
        whatever it reads: an estimate only changes what is read."""
        hq = sel.promoted.shape[0]
        blocks = BlockStats(sel.log_p.exp(), lay.eta, sel.delta_b, sel.v_rad, lay.quantized)
        everyone = torch.ones(hq, dtype=torch.bool, device=sel.promoted.device)
        limit = torch.full((hq,), self.ladder.bound_tol / 2, dtype=torch.float64,
                           device=sel.promoted.device)
        plan, pairs = targeted.tolerance_plan(blocks, (sel.promoted, sel.value_kv), everyone,
                                              limit)
        return (plan, pairs) if bool(plan.any()) else (None, 0)
