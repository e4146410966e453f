"""A batch's certified device step, stage by stage over every sequence (issue 54).

:meth:`~certkv.attention.CertifiedAttention.batch` decodes a batch of sequences, each on its
own stores. On the device path with the Triton kernels it runs the step of
:mod:`certkv.step` top to bottom once for the whole batch, each stage one launch over (sequence,
kv head, program): Phase 1, the selection, the page-in, Phase 2 and its merge (the checks and
the certificate in its epilogue), and the fallback (rungs 3-4, decided per (sequence, head)):
six launches per layer whatever the batch's size, as one sequence's step. What differs per
sequence (its buffers, strides, block counts, scratch cache, annotations, the step's scalars)
reaches the kernels through records (:mod:`certkv.kernels.records`); what the step makes has a
leading sequence axis, ``W`` block columns (the widest layout's), of which sequence ``s``'s
are its first ``n_s``: a sequence never reads another's columns, and no padding enters its
attention, mass, bound or statistics.

Each sequence gets the output and certificate its own step gives, bit for bit where the
reduction order is the same (the interpreter's; on a GPU a batch's programs walk as many blocks
as the batch's total asks, :func:`~certkv.kernels.triton_score.blocks_per_program`, which the
rounding chain's bound covers for any split). Steps the kernels do not cover (another
backend, mode or bound tolerance, eviction, an audit, exploration, a selection of its own)
run one sequence at a time.

Shapes: ``q [S, Hq, d]``; one store (and scratch cache or None) per sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from certkv.cache.store import TieredKVStore
from certkv.certify import fused_select
from certkv.certify.certificate import Certificate
from certkv.certify.segment import CertifyInputs
from certkv.fallback import record_faults
from certkv.kernels.page_in import on_device_batch
from certkv.kernels.reference import CheckInputs, Scored
from certkv.step import QuantizedStep, _Step
from certkv.timing import NULL_TIMER


class BatchedStep(QuantizedStep):
    """The batched device step (see the module); the base class of
    :class:`~certkv.attention.CertifiedAttention`."""

    def _batch_layouts(self, q: torch.Tensor, stores: Sequence[TieredKVStore],
                       scratches) -> list | None:
        """The step's layouts where :meth:`_device_batch` steps this batch (a certified step
        on the device path without a bound tolerance, the default selection, no audit,
        eviction, transient faults or phase timer, every store's phases on the kernels, one
        scratch cache per sequence or none), else None (each sequence steps alone)."""
        ladder = self.ladder
        if (self.mode != "certified" or self.audit or ladder.bound_tolerance
                or not self._on_device(q[0], False) or ladder.exploration > 0
                or getattr(self.timer, "per_phase", False)
                or not fused_select.covers(self.selector, ladder, self.value_policy, None, None)
                or q.device != stores[0].device or len(stores) < 2):
            return None
        if any(store.evicted_pid is not None or store.reads_draw_faults() for store in stores):
            return None  # (a fallback to each sequence alone would read transient faults twice)
        if scratches is not None and (any(s is None for s in scratches) or
                                      len({id(s) for s in scratches}) < len(scratches)):
            return None
        lays = [self._layout(store, True) for store in stores]  # the step's read of Tier-1
        return lays if self.backend.steps_batch_on_device(lays) else None

    def _device_batch(self, q: torch.Tensor, lays: list, scaling: float,
                      scratches) -> tuple[torch.Tensor, list[Certificate]]:
        """One certified device step of the batch, top to bottom (see the module): ``q [S,
        Hq, d]`` over the layouts of :meth:`_batch_layouts` -> ``(out [S, Hq, d],
        certificates)``."""
        timer = self.timer or NULL_TIMER
        nseq, hq, d = q.shape
        stores = [lay.store for lay in lays]
        hkv, device = stores[0].num_kv_heads, q.device
        scratches = scratches or [None] * nseq
        widths = [lay.num_blocks for lay in lays]
        qg = q.float().reshape(nseq, hkv, hq // hkv, d)
        steps = [_Step(q[s], qg[s], lay, scaling, True, None, timer, in_phase2=True)
                 for s, lay in enumerate(lays)]
        with timer.phase("phase1"):  # INT8 logits, block log-masses, Delta_b (eq. 8)
            scored = self.backend.phase1_batch(qg, lays, scaling)
        own = [_scored(scored, s, n) for s, n in enumerate(widths)]
        kv_of = self._kv_of(hq, hkv, device)
        with timer.phase("select"):  # the selection (paper 3.3), rungs 1 and 2
            sels, whole = self._select_batch(steps, scored, own, (qg, kv_of))
        with timer.phase("page_in"):  # FP16 blocks from the scratch caches or Tier-2
            maps, pools, paged = on_device_batch(scratches, lays, whole.plan,
                                                 self._no_pool(stores[0]))
        inputs = [self._pass_inputs(step, sc, sel, kv_of)
                  for step, sc, sel in zip(steps, own, sels, strict=True)]
        with timer.phase("phase2"):  # gated keys, FP16 values, checks and certificate
            merged, canary = self._phase2_batch(steps, scored, (whole, maps, pools), inputs,
                                                (q, qg))
        from certkv.kernels.triton_certify import finished

        done = finished(nseq, hq, device)
        results = []
        for s, (step, sel, page, pass_inputs) in enumerate(zip(steps, sels, paged, inputs,
                                                               strict=True)):
            att = merged.sequence(s, widths, hq // hkv)
            att.canary = canary[s, :, :, :widths[s]]
            results.append(self._pass_result(step, sel, page, att, pass_inputs,
                                             mendable=False, finished=_at(done, s)))
        with timer.phase("fallback"):  # rungs 3-4 per (sequence, head), decided first
            out = self.backend.dense_flagged_batch(
                q, stores, merged.out, scaling,
                (merged.certified, done, self._nonfinite_flags(device)))
        return out, [self._certificate(result, store, done.e_final[s], s)
                     for s, (result, store) in enumerate(zip(results, stores, strict=True))]

    def _select_batch(self, steps: list[_Step], scored: Scored, own: list[Scored], queries):
        """The batch's selection in one launch: each sequence's and the batch's
        :class:`~certkv.certify.segment.Selection` (:func:`~certkv.kernels.triton_select.
        select_batch`); ``queries``: ``(qg [S, Hkv, G, d], kv_of)``."""
        from certkv.kernels.triton_select import store_fields

        qg, kv_of = queries
        xs = [self._select_inputs(step, sc, kv_of, None, None)
              for step, sc in zip(steps, own, strict=True)]
        x = xs[0]._replace(qg=qg, l8_kv=scored.log_mass, delta_kv=scored.delta_b,
                           log_spread_kv=scored.log_spread)
        return self.backend.select_batch(
            self.selector, self.ladder, self.value_policy, x,
            [store_fields(xi, step.lay.num_blocks) for xi, step in zip(xs, steps, strict=True)])

    def _phase2_batch(self, steps: list[_Step], scored: Scored, paged_in: tuple, inputs: list,
                      queries: tuple):
        """Phase 2 of the batch and its merge with the checks and the certificate in its
        epilogue (two launches): the batch's selection, slot maps and pools in ``paged_in``,
        each sequence's :meth:`_pass_inputs` in ``inputs``, ``queries``: ``(q [S, Hq, d],
        qg [S, Hkv, G, d])``."""
        from certkv.kernels.triton_attend import Phase2Batch
        from certkv.kernels.triton_merge import CertifyBatch, sequence_fields

        whole, maps, pools = paged_in
        nseq, hkv, group = scored.log_mass.shape[:3]
        hq = hkv * group
        width = scored.log_mass.shape[3]
        requests = [self._certify_request(x, spec, step.lay)
                    for step, (_, _, spec, x) in zip(steps, inputs, strict=True)]
        first = requests[0]
        checks = None
        if inputs[0][0] is not None:  # the ranking and boundary checks
            checks = CheckInputs(scored.log_mass.reshape(nseq, hq, width), whole.delta_b,
                                 whole.promoted, [x[0].quantized for x in inputs],
                                 inputs[0][0].r)
        batch_x = _certify_x(first.x, scored, whole, queries[0])
        certify = CertifyBatch(batch_x, [sequence_fields(r.x, r.par, r.weights)
                                         for r in requests],
                               first.certified, first.canary, first.least, first.wanted)
        sources = [step.lay.kernel_sources("value") for step in steps]
        batch = Phase2Batch(scored.scores, scored.delta_b, queries[1],
                            whole.promoted.view(nseq, hkv, group, width), (maps[0], maps[1]),
                            [(src, step.lay.num_blocks, pool)
                             for src, step, pool in zip(sources, steps, pools, strict=True)])
        return self.backend.phase2_batch(batch, steps[0].scaling, self.ladder.eps_guard,
                                         checks, certify)

    def _certificate(self, result, store: TieredKVStore, e_arith: torch.Tensor,
                     s: int) -> Certificate:
        """Sequence ``s``'s certificate once the fallback chose ``e_arith``."""
        cert = result.certificate(e_arith, self.mode, None)
        if store.protection.enabled:
            record_faults(cert, store)
        cert.sequence = s
        return cert


def _scored(scored: Scored, s: int, n: int) -> Scored:
    """Sequence ``s``'s Phase-1 results (views of the batch's, its ``n`` block columns)."""
    return Scored(scores=scored.scores[s, :, :, :n], log_mass=scored.log_mass[s, :, :, :n],
                  delta_b=scored.delta_b[s, :, :, :n],
                  log_spread=scored.log_spread[s, :, :, :n])


def _certify_x(x: CertifyInputs, scored: Scored, whole, q: torch.Tensor) -> CertifyInputs:
    """The batch's certificate inputs: the step's tensors with a leading sequence axis
    (``x``'s store fields are read per sequence instead)."""
    nseq, hkv, group, width = scored.log_mass.shape
    return x._replace(l8=scored.log_mass.reshape(nseq, hkv * group, width),
                      delta_b=whole.delta_b, promoted=whole.promoted, log_p=whole.log_p,
                      delta_chan=whole.delta_chan, exact=whole.exact, value_kv=whole.value_kv,
                      delta=whole.delta, v_max=whole.v_max, v_rad=whole.v_rad,
                      q_norm=whole.q_norm, q=q, expanded=whole.expanded)


def _at(done, s: int):
    """Sequence ``s``'s views of the batch's :class:`~certkv.kernels.triton_certify.Finished`
    tensors."""
    return done._replace(**{name: getattr(done, name)[s] for name in done._fields})
