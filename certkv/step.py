"""The quantized decode step of :class:`~certkv.attention.CertifiedAttention`, top to bottom
(paper Algorithm 1): the layout, Phase 1 (INT8 scores), the selection (rung 1 and the value
promotions of rung 2), page-in, Phase 2 (gated keys, FP16 values), the ranking and boundary
checks, the certificate (eq. 15, Cor. 4.2) and the fallback (rungs 3-4, :mod:`certkv.fallback`),
each a call on named inputs and outputs: :class:`~certkv.certify.segment.SelectInputs` ->
:class:`~certkv.certify.segment.Selection`, :class:`~certkv.kernels.page_in.PagedIn`,
:class:`~certkv.certify.segment.CertifyInputs` -> :class:`~certkv.certify.segment.CertifyOutputs`
-> :class:`~certkv.certify.step_certify.StepPass`.

:class:`QuantizedStep` is the attention's base class: it holds no state of its own and reads
the attention's configuration (``selector``, ``value_policy``, ``ladder``, ``backend``,
``mode``, ``timer``, ``compile``, ``device_fallback``, ``pad_layout``) and caches. The pure
tensor math lives in :mod:`certkv.certify.step_select` and :mod:`certkv.certify.step_certify`;
which implementation runs each piece (a compiled or eager segment, a fused CPU loop nest) is
:mod:`certkv.dispatch`'s to say.

Shapes: ``q: [Hq, d]`` with ``Hq = G * Hkv``; per-head tensors ``[Hq]``; per-block tensors
``[Hq, n]`` where the ``n`` blocks are the store's quantized blocks followed, if present, by
the exact FP16 partial tail block.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from certkv.cache.appending import NONFINITE_KV
from certkv.cache.store import TieredKVStore
from certkv.certify import fused_cpu, fused_select, targeted
from certkv.certify.arith import U32, ArithSpec, as_tensors, step_coefficients
from certkv.certify.certificate import BlockStats
from certkv.certify.checks import paged_summaries
from certkv.certify.dropped import dropped_error, dropped_mass
from certkv.certify.segment import CertifyInputs, SelectInputs, Selection
from certkv.certify.step_certify import StepPass
from certkv.dispatch import Dispatch
from certkv.errors import NonFiniteError, require
from certkv.escalation import Escalation
from certkv.fallback import NONFINITE_Q, Fallback, record_faults
from certkv.kernels import numba_step
from certkv.kernels.layout import StepLayout
from certkv.kernels.page_in import NOTHING, PagedIn, on_device, stage_blocks, tier2_stage
from certkv.kernels.reference import CheckInputs, dense_rounding, without_blocks
from certkv.timing import NULL_TIMER, PhaseTimer


class _Step(NamedTuple):
    """One quantized step's fixed inputs, shared by its passes."""

    q: torch.Tensor  # [Hq, d] on the store's device, the caller's dtype
    qg: torch.Tensor  # [Hkv, G, d] FP32
    lay: StepLayout
    scaling: float
    on_device: bool  # rungs 3-4 (and page-in where the backend can) without a host read
    pager: Callable  # plan [2, Hkv, n] -> PagedIn
    timer: PhaseTimer
    in_phase2: bool = False  # the certificate in Phase 2's merge, the rungs in the fallback


class QuantizedStep(Escalation, Fallback, Dispatch):
    """The naive and certified steps and their fallback (see the module); the base class of
    :class:`~certkv.attention.CertifiedAttention`, whose fields it reads."""

    def _arith_spec(self, q: torch.Tensor, store: TieredKVStore, scaling: float,
                    lay: StepLayout | None, on_device: bool = False) -> ArithSpec:
        """The static facts of the arithmetic bound for this step (host only), one object per
        distinct setting (a stable constant for the compiled certificate segment). On the
        device path rungs 3-4 are the backend's fallback kernel, with its own rounding."""
        dense, dense_u = dense_rounding(q, torch.float16)
        if on_device:
            dense, dense_u = self.backend.fallback_rounding(store), U32
        rounding = self.backend.rounding(lay) if lay is not None else dense
        spec = ArithSpec(head_dim=store.head_dim, block_size=store.block_size, scaling=scaling,
                         mass_inflation=self.selector.mass_inflation, out_dtype=q.dtype,
                         rounding=rounding, dense_rounding=dense, dense_u=dense_u,
                         value_decode=store.value_decode_rounding())
        return self._specs.setdefault(spec, spec)

    # -------------------------------------------------------- quantized modes
    def _quantized_step(self, q, store, scaling, scratch=None):
        """Naive and certified steps, top to bottom: the layout, Phase 1, the pass (selection,
        page-in, Phase 2, checks, certificate), the fallback (rungs 3-4), the certificate. With
        ``ladder.bound_tol`` / ``bound_rtol`` set, a head whose returned bound exceeds its
        tolerance escalates (:meth:`_passes`). The numba backend runs the default certified
        step as one compiled call (:meth:`_one_call`)."""
        timer = self.timer or NULL_TIMER
        tolerant = self.mode == "certified" and self.ladder.bound_tolerance
        on_device = self._on_device(q, tolerant)  # no host read: flags, and page-in if covered
        hkv = store.num_kv_heads
        qg = q.float().reshape(hkv, q.shape[0] // hkv, -1)
        boost, e_drop = None, None
        if numba_step.covers(self, q, store, on_device, tolerant):
            fused, arrays, spec, dense_heads = self._one_call(q, qg, store, scaling, scratch,
                                                              timer)
            result = fused.step_pass(arrays, spec)
        else:
            with timer.phase("layout"):
                lay = self._layout(store, on_device)
            step = _Step(q, qg, lay, scaling, on_device, self._pager(lay, scratch, on_device),
                         timer)
            with timer.phase("phase1"):  # INT8 logits, block log-masses, Delta_b (eq. 8)
                scored = self.backend.phase1(qg, lay, scaling)
            scored, e_drop = self._drop_evicted(step, scored)
            step = step._replace(in_phase2=on_device and e_drop is None)
            result, boost, dense_heads = self._passes(step, scored, e_drop, tolerant)
        with timer.phase("fallback"):
            if on_device:
                out, e_arith = self._fallback_on_device(q, store, result, scaling)
            else:
                out, e_arith = self._fallback(q, store, result, dense_heads, scaling)
        if e_drop is not None:  # naive eviction's dropped mass joins the returned E_key
            result.add_key_error(e_drop)
        cert = result.certificate(e_arith, self.mode, boost)
        if store.protection.enabled:
            record_faults(cert, store)
        return out, cert

    def _pass(self, step: _Step, scored, boost, force=None, mendable=True,
              ahead=False) -> StepPass:
        """Selection, page-in, Phase 2, checks and the certificate of one pass over the
        Phase-1 ``scored`` (``boost [Hq]``: the bound-tolerance escalation level per head, or
        None; ``force [Hq, n]``: blocks promoted by targeted page-in, or None; ``ahead``: also
        the blocks :meth:`_tolerance_ahead` plans); the fallback is left to the caller (on the
        device path the certificate segment also returns every head's dense ``e_arith`` for
        it)."""
        q, lay, timer, device = step.q, step.lay, step.timer, step.q.device
        store, lad = lay.store, self.ladder
        hkv, certified = store.num_kv_heads, self.mode == "certified"
        hq = q.shape[0]
        kv_of = self._kv_of(hq, hkv, device)

        # Selection (paper 3.3), rung 1 and value promotion (rung 2): device tensors only
        with timer.phase("select"):
            sel = self._selection(step, scored, kv_of, boost, force)
            planned, ahead_pairs = self._tolerance_ahead(lay, sel) if ahead else (None, 0)
            if planned is not None:
                force = planned if force is None else force | planned
                sel = self._selection(step, scored, kv_of, boost, force)

        # Page-in (on the host: the step's first host read; on the device: none) and Phase 2
        # (gated keys, FP16 values).
        with timer.phase("page_in"):
            paged = step.pager(sel.plan) if certified else NOTHING
        checks, summaries, spec, inputs = self._pass_inputs(step, scored, sel, kv_of)
        with timer.phase("phase2"):  # with the certificate in its merge where the backend can
            gate = sel.promoted.reshape(hkv, hq // hkv, -1)
            extra = {"certify": self._certify_request(inputs, spec, lay)} \
                if step.in_phase2 and summaries is None \
                and self.backend.certifies_in_phase2(lay) else {}
            att = self.backend.phase2(step.qg, scored, lay, gate, (paged.keys, paged.values),
                                      step.scaling, lad.eps_guard,
                                      checks if summaries is None else None, **extra)
        return self._pass_result(step, sel, paged, att, (checks, summaries, spec, inputs),
                                 mendable=mendable, force=force, ahead_pairs=ahead_pairs)

    def _pass_inputs(self, step: _Step, scored, sel: Selection, kv_of):
        """What a pass's Phase 2 and certificate read besides Phase 2's own results:
        ``(checks, summaries, spec, inputs)`` (the ranking and boundary checks' inputs or None,
        the evicted columns the checks rank by FP16 log-mass or None, the arithmetic bound's
        facts, the certificate's :class:`CertifyInputs` with Phase 2's fields None)."""
        q, lay, lad = step.q, step.lay, self.ladder
        store, certified, hq = lay.store, self.mode == "certified", q.shape[0]
        l8 = scored.log_mass.reshape(hq, -1)
        checks = CheckInputs(l8, sel.delta_b, sel.promoted, lay.quantized, lad.r) \
            if certified and (lad.ranking_check or lad.boundary_check) else None
        summaries = None if checks is None or lad.rank_summaries or not lad.ranking_check \
            else _evicted_columns(lay)  # eq. 17 after Phase 2, paged-in summaries by FP16
        spec = self._arith_spec(q, store, step.scaling, lay, step.on_device)
        inputs = CertifyInputs(  # Phase 2's fields (None) follow it
            l8=l8, l16=None, rho=None, spread=None, out=None, log_p=sel.log_p,
            delta_b=sel.delta_b, delta=sel.delta, delta_chan=sel.delta_chan, v_max=sel.v_max,
            v_rad=sel.v_rad, q_norm=sel.q_norm, promoted=sel.promoted, exact=sel.exact,
            expanded=sel.expanded, value_kv=sel.value_kv, eta=lay.eta,
            value_spec=lay.value_spec, key_spec=lay.key_spec, ranking=None, boundary=None,
            canary_blocks=None, q=q, kv_bad=store.nonfinite_appended(),
            key_abs_max=store.key_abs_max(), eta_max_kv=store.value_error_max(), kv_of=kv_of,
            v_max_kv=store.value_norm_max() if step.on_device else None)
        return checks, summaries, spec, inputs

    def _pass_result(self, step: _Step, sel: Selection, paged, att, pass_inputs, *,
                     mendable=True, force=None, ahead_pairs=0, finished=None) -> StepPass:
        """A pass's :class:`StepPass` from Phase 2's results ``att`` and ``pass_inputs``
        (:meth:`_pass_inputs`): the ranking and boundary checks (eq. 17-18: Phase 2's
        epilogue, or one small call), and the certificate (eq. 15, Cor. 4.2), computed in
        Phase 2's merge (its rungs left to the fallback kernel, which writes them into
        ``finished`` where given) or by the certificate segment."""
        checks, summaries, spec, inputs = pass_inputs
        lay, timer, hq = step.lay, step.timer, step.q.shape[0]
        l8 = inputs.l8
        l16 = att.log_mass.reshape(hq, -1)
        if summaries is not None:  # a promoted evicted block ranks by its FP16 log-mass
            checks = checks._replace(l_int8=paged_summaries(l8, l16, sel.promoted, summaries))
        with timer.phase("checks"):
            ranking, boundary = self._rank_checks(checks, l16, att)
        out = att.out.reshape(hq, -1)
        inputs = inputs._replace(l16=l16, rho=att.rho.reshape(hq, -1),
                                 spread=_spread(att).reshape(hq, -1), out=out, ranking=ranking,
                                 boundary=boundary, canary_blocks=att.canary)
        pending = None
        if att.certified is not None:  # rungs left to the fallback kernel
            from certkv.kernels.triton_certify import outputs

            cert, finished = outputs(att.certified, finished)
            pending = (att.certified, finished)
        else:
            with timer.phase("certificate"):
                cert = self._certify(inputs, spec, lay, step.on_device)
        blocks = BlockStats(inputs.rho, lay.eta, sel.delta_b, sel.v_rad, lay.quantized)
        mend = self._mend(step, checks, l16, sel, boundary) if mendable else None
        return StepPass(out, spec, cert, sel.delta, ranking, boundary, blocks,
                        lay.num_quantized, paged.promotions, paged.paged_evicted, mend,
                        targeted=ahead_pairs, pending=pending, read=(sel.promoted, sel.value_kv),
                        forced=force, ahead=ahead_pairs)

    def _mend(self, step: _Step, checks: CheckInputs | None, l16, sel: Selection, boundary):
        """What targeted page-in needs where it applies (certified, the boundary check on, a
        store with evicted blocks, the host path, a budget above 0, some head failing eq. 18):
        the breaking blocks, their upper bounds and the kv heads' keys read; else None."""
        store = step.lay.store
        if (checks is None or not self.ladder.boundary_check or step.on_device
                or store.evicted_pid is None or self.ladder.page_in_budget == 0
                or bool(boundary.all())):
            return None
        breakers, upper = targeted.boundary_breakers(
            checks.l_int8, l16, checks.delta_b, checks.promoted, checks.quantized, checks.r)
        return breakers, upper, sel.plan[0]

    def _selection(self, step: _Step, scored, kv_of, boost, force=None) -> Selection:
        """The selection segment's inputs from Phase 1 and the layout, then the segment: one
        fused CPU loop nest where it covers the step, the backend's kernels on a device step
        (:meth:`~certkv.kernels.base.Backend.select`), else the PyTorch (compiled) segment."""
        q, certified = step.q, self.mode == "certified"
        inputs = self._select_inputs(step, scored, kv_of, boost, force)
        draw = inputs.draw
        if self._fused_select(q.device, draw, boost, step.on_device):
            return fused_select.select(self.selector, self.ladder, self.value_policy, inputs)
        if step.in_phase2 and certified and force is None and fused_select.covers(
                self.selector, self.ladder, self.value_policy, draw, boost):
            chosen = self.backend.select(self.selector, self.ladder, self.value_policy, inputs)
            if chosen is not None:  # the backend's kernels
                return chosen
        return self._segment("_select_step", q.device)(inputs)

    def _select_inputs(self, step: _Step, scored, kv_of, boost, force) -> SelectInputs:
        """The selection's :class:`SelectInputs` from Phase 1's ``scored`` and the layout
        (the exploration's draw made here)."""
        lay, q = step.lay, step.q
        draw = self.ladder.exploration_draw((q.shape[0], lay.quantized.numel()), q.device) \
            if self.mode == "certified" else None
        return SelectInputs(
            qg=step.qg, l8_kv=scored.log_mass, delta_kv=scored.delta_b,
            log_spread_kv=_log_spread(scored), quantized=lay.quantized, eta=lay.eta,
            value_spec=lay.value_spec, key_err=lay.key_err, v_max_kv=lay.v_max,
            v_rad_kv=lay.v_radius, kv_of=kv_of, draw=draw,
            n_q=lay.quantized_count if step.on_device else lay.num_quantized,
            scaling=step.scaling, boost=boost, force=force)  # on the device n_q changes in place

    def _certify_request(self, inputs: CertifyInputs, spec, lay: StepLayout):
        """What Phase 2's merge needs to compute the certificate on the device path
        (:class:`~certkv.kernels.triton_certify.CertifyRequest`): the inputs, the step's
        scalars and weights at the layout's coefficients, the rungs' settings."""
        from certkv.kernels.triton_certify import CertifyRequest, scalars

        lad, device = self.ladder, inputs.q.device
        coef = step_coefficients(spec, lay.num_blocks, _counted_tokens(lay, True), device)
        par = scalars(spec, coef, float(self.selector.mass_inflation), device)
        hq = inputs.q.shape[0]
        return CertifyRequest(inputs, par, coef.weights, self.mode == "certified", lad.canary,
                              max(1.0, lad.layer_dense_fraction * hq),
                              int(lad.ranking_check) | 2 * int(lad.boundary_check))

    def _certify(self, inputs: CertifyInputs, spec, lay: StepLayout, on_device: bool):
        """The certificate segment at this step's coefficients: fused CPU loop nests, or the
        PyTorch (compiled) segment, whose coefficients are tensors so that a changing token
        count does not recompile it."""
        device = inputs.q.device
        coef = step_coefficients(spec, lay.num_blocks, _counted_tokens(lay, on_device), device)
        if self._fused_cpu(device, on_device):
            return self._certify_fused(inputs, spec, coef)
        if self._compiler(device):
            coef = as_tensors(coef, device)
        return self._segment("_certify_step", device)(inputs, spec, coef)

    def _one_call(self, q, qg, store, scaling, scratch, timer):
        """Phase 1 and one certified pass as one compiled call on the numba backend
        (:mod:`certkv.kernels.numba_step`: the phase-by-phase step's numbers, bit for bit) over
        the store's arrays (made again only when a block completes or a buffer grows:
        :func:`~certkv.kernels.numba_step.store_arrays`); the scratch cache counts the FP16
        blocks read from Tier-2 in place as the host page-in has it do. Returns the call's
        :class:`~certkv.kernels.numba_step.Fused`, the store's
        :class:`~certkv.kernels.numba_step.StoreArrays`, the step's :class:`ArithSpec` and the
        heads flagged for rungs 3-4 (host indices): the call's counts say whether any head is
        flagged or any input non-finite, so a step with none reads no flag."""
        with timer.phase("layout"):
            arrays = numba_step.store_arrays(store)
        key = (self.backend.name, q.dtype, scaling, self.selector.mass_inflation)
        spec = arrays.specs.get(key)
        if spec is None:  # once per store layout and query kind
            spec = self._arith_spec(q, store, scaling, StepLayout(store, read=False))
            arrays.specs[key] = spec
        params = self._one_call_params(spec, arrays.num_blocks, store.num_tokens)
        with timer.phase("step"):
            f = numba_step.run(self, q, qg, store, arrays, scaling, params)
        flagged, bad_q, bad_kv, keys_read, values_read = f.counts
        if scratch is not None:
            plan = f.plan.numpy()  # [2, Hkv, n] FP16 keys, values read
            for which, mask, read in (("k", plan[0], keys_read), ("v", plan[1], values_read)):
                if read:
                    scratch.record(store, mask, which)
        dense_heads = self._host_flags(f.flags)[0] if flagged or bad_q or bad_kv else NO_HEADS
        return f, arrays, spec, dense_heads

    def _one_call_params(self, spec: ArithSpec, num_blocks: int, num_tokens: int) -> tuple:
        """The certificate's scalars and weights for :meth:`_one_call`
        (:func:`~certkv.certify.fused_cpu._params` of :func:`step_coefficients`), the last
        step's while ``spec`` (one object per setting) and the counts are the same: every layer
        of a decode step asks for them, and hashing the spec twice a layer cost more than the
        numbers."""
        last = self._constants.get("one_call")
        if last is None or last[0] is not spec or last[1:3] != (num_blocks, num_tokens):
            coef = step_coefficients(spec, num_blocks, num_tokens, "cpu")
            last = (spec, num_blocks, num_tokens,
                    fused_cpu._params(spec, coef, self.selector.mass_inflation))
            self._constants["one_call"] = last
        return last[3]

    def _layout(self, store: TieredKVStore, on_device: bool) -> StepLayout:
        """The step's layout: on the device path with the kernels running both phases, a tail
        block column always (empty right after a block completes), so that the launches change
        only when a block completes, and with :attr:`pad_layout` empty blocks up to the store's
        block capacity, so that they change only when its buffers grow (:meth:`graph_layout`)."""
        lay = StepLayout(store)
        if on_device and self.backend.takes_empty_tail(lay):
            if self.pad_layout and store.num_blocks:
                return StepLayout(store, read=False, width=store.block_capacity())
            if not store.tail_len:
                lay = StepLayout(store, empty_tail=True, read=False)  # the words just checked
        return lay

    def _drop_evicted(self, step: _Step, scored):
        """Naive eviction, as kvpress does it: a naive step leaves evicted blocks out of
        attention (their Phase-1 scores masked: zero mass, no ``Delta_b``) and adds ``E_drop``
        (:mod:`certkv.certify.dropped`) to ``E_key`` for their mass, bounded from their Tier-1
        summaries' Phase-1 scores. Returns ``(scored, e_drop [Hq] or None)``; certified steps
        keep every block (summaries in the bound, page-in by the ladder)."""
        q, lay = step.q, step.lay
        store = lay.store
        if self.mode != "naive" or store.evicted_pid is None:
            return scored, None
        dropped = _evicted_columns(lay)
        if dropped is None:
            return scored, None
        hq, group = q.shape[0], q.shape[0] // store.num_kv_heads
        mass = dropped_mass(self._arith_spec(q, store, step.scaling, lay), q=q,
                            key_abs_max=store.key_abs_max(), l8=scored.log_mass.reshape(hq, -1),
                            delta_b=scored.delta_b.reshape(hq, -1), dropped=dropped,
                            n_tokens=store.num_tokens)
        v_rad = torch.minimum(lay.v_radius, lay.v_max).repeat_interleave(group)
        return without_blocks(scored, dropped), dropped_error(mass, v_rad)

    def _rank_checks(self, checks: CheckInputs | None, l16, att):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]``: from Phase 2's epilogue
        where the backend ran them there, else one backend call; all True where disabled
        (``checks`` None: not certified, or both checks off)."""
        lad = self.ladder
        wanted = (False, False) if checks is None else (lad.ranking_check, lad.boundary_check)
        flags = (None, None)
        if checks is not None:
            flags = (att.ranking, att.boundary) if att.ranking is not None \
                else self.backend.checks(checks.l_int8, l16, checks.delta_b, checks.promoted,
                                         checks.quantized, checks.r)
        if all(wanted):
            return flags
        true = torch.ones(l16.shape[0], dtype=torch.bool, device=l16.device)
        return tuple(f if on else true for f, on in zip(flags, wanted, strict=True))
    def _pager(self, lay: StepLayout, scratch, on_device: bool):
        """The step's page-in, ``plan [2, Hkv, n] -> PagedIn``: on the device where the backend
        pages in there (:meth:`_page_in_on_device`), else on the host from the scratch cache or
        straight from Tier-2 (:func:`~certkv.kernels.page_in.stage_blocks`, after the plan's
        host read: the step's first; Tier-2 lives in host memory, so the host must know what to
        copy)."""
        if on_device and self.backend.pages_in_on_device(lay):
            return partial(self._page_in_on_device, scratch, lay)
        store = lay.store
        if scratch is None:
            stage, record = partial(tier2_stage, store), None
        else:
            stage, record = partial(scratch.stage, store), partial(scratch.record, store)
        return lambda plan: stage_blocks(self.backend, lay, to_host(plan), stage, record)

    def _page_in_on_device(self, scratch, lay, plan) -> PagedIn:
        """:func:`~certkv.kernels.page_in.on_device` with this attention's empty pool."""
        return on_device(scratch, lay, plan, self._no_pool(lay.store))

    def _no_pool(self, store) -> torch.Tensor:
        """A one-block FP16 pool for slot maps without slots (never read; cached)."""
        key = ("pool", store.device, store.block_size, store.head_dim)
        if key not in self._constants:
            self._constants[key] = torch.zeros(1, store.block_size, store.head_dim,
                                              dtype=torch.float16, device=store.device)
        return self._constants[key]

    def _host_flags(self, flags, over=None):
        """The step's second host read: which heads need dense attention (Tier-2 is on the host),
        with the deferred finiteness checks of ``q`` and of the appended K/V (``flags [Hq + 2]``)
        and, when a bound tolerance is set, which heads exceed it (``over [Hq]``). Returns the
        host indices of both sets of heads."""
        hq = flags.shape[0] - 2
        flags = to_host(flags if over is None else torch.cat([flags, over]))
        dense, bad = flags[:hq], flags[hq : hq + 2].tolist()
        require(not bad[0], NonFiniteError, NONFINITE_Q)
        require(not bad[1], NonFiniteError, NONFINITE_KV)
        over = flags[hq + 2:] & ~dense if over is not None else dense[:0]
        return dense.nonzero(as_tuple=True)[0], over.nonzero(as_tuple=True)[0]

    def synchronize(self) -> None:
        """Raise the non-finite inputs of the steps since the last call (one host read), as
        the steps themselves do where the fallback reads its flags on the host."""
        if self._nonfinite is None:
            return
        bad_q, bad_kv = to_host(self._nonfinite).tolist()  # (on a CPU: the tensor itself)
        self._nonfinite.zero_()
        require(not bad_q, NonFiniteError, NONFINITE_Q)
        require(not bad_kv, NonFiniteError, NONFINITE_KV)


NO_HEADS = torch.empty(0, dtype=torch.long)  # no head flagged (never written)


def _counted_tokens(lay: StepLayout, on_device: bool) -> int:
    """The token count a step's arithmetic coefficients are taken at: the store's, or on the
    device path the layout's ``n B`` slots (the coefficients grow with the count, so they stay
    valid as the tail block fills, and a step captured in a graph replays them,
    :mod:`certkv.graphs`)."""
    store = lay.store
    return lay.num_blocks * store.block_size if on_device else store.num_tokens


def _log_spread(scored) -> torch.Tensor:
    """Phase-1 block log-spreads ``[Hkv, G, n]`` (a backend without them: ``log_mass``, i.e.
    the spread bounded by the mass, which leaves the tight value contribution at the paper's)."""
    return scored.log_mass if scored.log_spread is None else scored.log_spread


def _spread(att) -> torch.Tensor:
    """Phase-2 block spreads ``[Hkv, G, n]`` (a backend without them: ``rho``, an upper bound
    since ``||p_b||_2 <= ||p_b||_1``)."""
    return att.rho if att.spread is None else att.spread


def to_host(x: torch.Tensor) -> torch.Tensor:
    """Every device-to-host read of a decode step goes through here (at most two per step:
    the page-in plan and the fallback flags); tests count the calls."""
    return x.to("cpu")


def _evicted_columns(lay: StepLayout) -> torch.Tensor | None:
    """Bool ``[n]`` on the store's device: the layout's columns held at their Tier-1 summary
    only (evicted), False on the tail block's and after; None where no block is evicted."""
    store = lay.store
    if store.evicted_pid is None:
        return None
    evicted = store.evicted_mask()  # host
    if not bool(evicted.any()):
        return None
    extra = torch.zeros(lay.num_blocks - evicted.numel(), dtype=torch.bool)
    return torch.cat([evicted, extra]).to(store.device, non_blocking=True)
