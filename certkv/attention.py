"""CertifiedAttention: one decode step of one layer -> ``(output, Certificate)``.

Composes a selector, a value policy, a ladder and a backend over a :class:`TieredKVStore`
(paper Algorithm 1 and Section 3.4). Every head either returns ``O_quant`` with
``||O_quant - O_ref||_2 <= E_key + E_val + E_arith`` or dense attention on the FP16 originals
with ``||O_dense - O_ref||_2 <= E_arith``, ``O_ref`` being attention in exact arithmetic on the
FP16 originals (:mod:`certkv.certify.arith`).

Shapes: ``q: [Hq, d]`` with ``Hq = G * Hkv`` (query head ``h`` reads kv head ``h // G``);
per-head tensors ``[Hq]``; per-block tensors ``[Hq, n]`` where the ``n`` blocks are the store's
quantized blocks followed, if present, by the exact FP16 partial tail block.
"""

from __future__ import annotations

import math
import numbers
import weakref
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from certkv.cache.device_scratch import slot_maps
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import NONFINITE_KV, TieredKVStore
from certkv.certify import fused_cpu, fused_select
from certkv.certify.arith import (
    U32,
    ArithSpec,
    as_tensors,
    dense_arith,
    logit_terms,
    quantized_arith,
    step_coefficients,
    widened_blocks,
    widened_key_inputs,
)
from certkv.certify.audit import violations
from certkv.certify.bounds import (
    block_tv_bound,
    key_error_bound,
    logit_error_norms,
    tail_logit,
    tail_mass_bound,
    tightened_deltas,
    value_error_bound,
    value_error_bound_tight,
)
from certkv.certify.certificate import BlockStats, Certificate
from certkv.certify.checks import exploration_mask
from certkv.certify.dropped import dropped_error, dropped_mass
from certkv.certify.ladder import Ladder
from certkv.certify.segment import CertifyInputs, CertifyOutputs, SelectInputs, Selection
from certkv.certify.select import AdaptiveTopK
from certkv.certify.values import LocalThreshold
from certkv.errors import ConfigError, EmptyStoreError, NonFiniteError, ShapeError, require
from certkv.kernels import numba_step
from certkv.kernels.compiled import CompiledSegment
from certkv.kernels.dispatch import get_backend
from certkv.kernels.layout import SlotMap, StagedBlocks, StepLayout
from certkv.kernels.reference import CheckInputs, dense_rounding, without_blocks
from certkv.timing import NULL_TIMER, PhaseTimer

MODES = ("certified", "naive", "dense")
_NONFINITE_Q = "q holds NaN or Inf; check the model's activations before attention."


TOL_LEVELS = 3  # bound-tolerance escalation: 1 widest key set, 2 + FP16 values, 3 dense


@dataclass
class _Pass:
    """What one pass of a quantized step computed, per query head (``[Hq]`` unless noted)."""

    out: torch.Tensor  # [Hq, d] FP32, before the fallback
    spec: ArithSpec
    flags: torch.Tensor  # [Hq + 2]: heads needing dense attention, non-finite q, K/V
    e_key: torch.Tensor
    e_val: torch.Tensor
    e_arith: torch.Tensor
    delta: torch.Tensor
    tail_mass: torch.Tensor
    k_star: torch.Tensor
    rung: torch.Tensor
    ranking: torch.Tensor
    boundary: torch.Tensor
    canary: torch.Tensor
    value_blocks: torch.Tensor
    value_promotions: int
    num_blocks: int
    paper_key: torch.Tensor
    paper_val: torch.Tensor
    blocks: BlockStats
    paged_evicted: int = 0
    returned: tuple | None = None  # e_key, e_val [Hq] as returned (0 on rungs 3-4)
    e_final: torch.Tensor | None = None  # [Hq] e_arith after the device fallback (device path)

    @property
    def bound(self) -> torch.Tensor:
        """The bound a head would return on the quantized path."""
        return self.e_key + self.e_val + self.e_arith

    def certificate(self, e_arith: torch.Tensor, mode: str, boost) -> Certificate:
        """The step's certificate once the fallback chose ``e_arith`` (dense heads' own)."""
        e_key, e_val = self.returned
        return Certificate(
            candidate_e_key=self.e_key, candidate_e_val=self.e_val, e_key=e_key, e_val=e_val,
            e_arith=e_arith, delta=self.delta, tail_mass=self.tail_mass,
            k_star=self.k_star, rung=self.rung, ranking_ok=self.ranking,
            boundary_ok=self.boundary, canary_ok=self.canary, value_blocks=self.value_blocks,
            value_promotions=self.value_promotions, num_blocks=self.num_blocks, mode=mode,
            paper_e_key=self.paper_key, paper_e_val=self.paper_val, tol_level=boost,
            blocks=self.blocks, paged_evicted=self.paged_evicted)


def _dense_where_unbounded(step: _Pass, e_drop: torch.Tensor) -> None:
    """A naive step's heads whose dropped-mass bound ``e_drop [Hq]`` is not finite (evicted
    blocks' summaries corrupted by faults) go dense, as a head whose own bound is not finite
    does (:meth:`CertifiedAttention._rungs`): never a NaN or infinite bound on rungs 0-2."""
    unbounded = ~(e_drop < math.inf)
    step.rung = torch.where(unbounded, step.rung.clamp(min=3), step.rung)
    hq = unbounded.numel()
    step.flags = torch.cat([step.flags[:hq] | unbounded, step.flags[hq:]])
    step.returned = _returned(step.rung, step.e_key, step.e_val)


def _returned(rung, e_key, e_val) -> tuple[torch.Tensor, torch.Tensor]:
    """E_key and E_val ``[Hq]`` as a head returns them: 0 on rungs 3-4 (dense heads)."""
    fast = rung < 3
    return torch.where(fast, e_key, 0.0), torch.where(fast, e_val, 0.0)


def _key_bound(log_p, tail, delta_b, delta, v_max, exponent, cap_logit=None, tv_cap=None):
    """``(log alpha_hat, Delta_T, E_key)``, each ``[Hq]``, for INT8 tail blocks ``tail: [Hq, n]``
    (eq. 15); ``cap_logit`` gives an extra valid bound on the true tail mass (after Phase 2),
    ``tv_cap`` one on TV itself (the per-block bound)."""
    log_alpha = torch.logsumexp(torch.where(tail, log_p, float("-inf")), dim=-1)
    delta_tail = torch.where(tail, delta_b, 0.0).amax(dim=-1)
    e_key = key_error_bound(v_max, delta, delta_tail, log_alpha, exponent, cap_logit, tv_cap)
    return log_alpha, delta_tail, e_key


NEG_INF = float("-inf")


def _on(mask, x, other=0.0):
    """``x`` where ``mask``, ``other`` (0) elsewhere (same shape)."""
    return torch.where(mask, x, other)


@dataclass
class CertifiedAttention:
    """Certified attention for one decode step (defaults: the paper's Table 2 policy).

    Args:
        selector: chooses the FP16-key set (``AdaptiveTopK``).
        value_policy: chooses blocks read with FP16 values (``LocalThreshold(v_tol=0.05)``).
        ladder: rung 1-4 escalation and monitors (``Ladder``).
        backend: ``"auto"``, ``"torch"``, ``"triton"``, ``"numba"`` or a backend object.
        mode: ``"certified"``; ``"naive"`` (same quantized store, no promotion, no ladder);
            ``"dense"`` (SDPA on the FP16 originals).
        compile: ``torch.compile`` the selection and certificate segments (dozens of small ops
            -> a few fused kernels): ``None`` = on CUDA (on a CPU they run as numba loop nests
            instead: :mod:`certkv.certify.fused_cpu`, :mod:`certkv.certify.fused_select`),
            ``False`` = never (the PyTorch operators everywhere: the reference), ``True`` =
            inductor, or a dynamo backend name (tests use ``"aot_eager"``).
        device_fallback: rungs 3-4 without a host read (issue 24): one kernel recomputes the
            flagged heads from the FP16 originals in place, and non-finite inputs do not raise
            at the step but give it an invalid certificate (bound ``inf``) and raise at
            :meth:`synchronize` (which the transformers cache's log reaches at every step
            boundary). ``None``: where the backend has the kernel (``triton``) and neither an
            FP64 query nor ``ladder.bound_tol`` needs the host; ``False``: read the flags.

    Attributes:
        pad_layout: on the device path, pad each step's layout to the store's block capacity
            (:class:`~certkv.kernels.layout.StepLayout`'s ``width``) so that its launches and
            shapes stay the same while blocks complete; ``e_arith`` then counts the padded
            token slots. :class:`~certkv.graphs.GraphedAttention` turns it on (default off).
    """

    selector: AdaptiveTopK = field(default_factory=AdaptiveTopK)
    value_policy: object = field(default_factory=LocalThreshold)
    ladder: Ladder = field(default_factory=Ladder)
    backend: object = "auto"
    mode: str = "certified"
    timer: PhaseTimer | None = None  # set by benchmarks to time each phase (Table 16)
    compile: bool | str | None = None
    audit: bool = False  # count heads over their bound against FP64 (certify.audit; slow)
    device_fallback: bool | None = None

    def __post_init__(self) -> None:
        require(self.mode in MODES, ConfigError,
                f"mode={self.mode!r} is unknown; choose one of {list(MODES)}.")
        self.backend = get_backend(self.backend)
        self._compiled: dict = {}
        self._constants: dict = {}  # per-shape constants: kv_of (_kv_of), _no_pool
        self._specs: dict[ArithSpec, ArithSpec] = {}
        self._nonfinite: torch.Tensor | None = None  # [2] q, K/V since the last synchronize()
        self.pad_layout = False  # (issue 24's bucketed block counts, class docstring)
        # per store: (graph signature, whether the kernels take its empty tail block), asked by
        # graph_layout at every graphed step and the same while the signature holds
        self._empty_tail: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    # ----------------------------------------------------------------- entry
    def __call__(
        self, q: torch.Tensor, store: TieredKVStore, scaling: float | None = None,
        scratch: ScratchCache | None = None,
    ) -> tuple[torch.Tensor, Certificate]:
        """One decode step: ``q [Hq, d]`` against ``store`` -> ``(out [Hq, d], Certificate)``.

        ``scratch`` (optional) serves promoted FP16 blocks from device memory before Tier-2.
        """
        self._check(q, store)
        scaling = _scaling(store.head_dim, scaling)
        q_dev = q.to(store.device)
        if self.mode == "dense":  # the baseline: no host reads on accelerators, as plain SDPA
            if store.device.type == "cpu":
                require(bool(torch.isfinite(q).all()), NonFiniteError, _NONFINITE_Q)
            out, cert = self._dense_step(q_dev, store, scaling)
        else:
            out, cert = self._quantized_step(q_dev, store, scaling, scratch)
        if self.audit:
            k, v = store.dense_kv()
            violated, error = violations(out, cert.bound, q_dev, k, v, scaling)
            cert.violations, cert.error = int(violated.sum()), error.float()
            cert.audited = True
        return out, cert

    def decoded_mirror(self, device: torch.device) -> bool | str:
        """The ``decoded_mirror`` of a store this attention reads on ``device``
        (:class:`TieredKVStore`): none in dense mode (it reads the FP16 originals), else its
        backend's (the whole mirror on a CPU; ``"lean"`` where the numba loops run)."""
        if self.mode == "dense":
            return False
        return self.backend.decoded_mirror(device)

    def graph_ready(self, q: torch.Tensor, store: TieredKVStore) -> bool:
        """Whether a step of ``q`` over ``store`` reads no host value, so that it can be
        captured in a graph and replayed (:mod:`certkv.graphs`): a quantized mode whose
        fallback runs on the device, without an audit."""
        return (self.mode != "dense" and not self.audit and store.device == q.device
                and self._on_device(q, self.mode == "certified"
                                    and self.ladder.bound_tolerance))

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

    def _check(self, q: torch.Tensor, store: TieredKVStore) -> None:
        require(isinstance(q, torch.Tensor) and q.dim() == 2, ShapeError,
                "q must be a 2-D tensor [num_query_heads, head_dim] for one decode step; "
                "squeeze batch and time dimensions first.")
        require(q.shape[1] == store.head_dim, ShapeError,
                f"q has head_dim {q.shape[1]} but the store holds head_dim {store.head_dim}.")
        require(q.shape[0] % store.num_kv_heads == 0 and q.shape[0] > 0, ShapeError,
                f"q has {q.shape[0]} heads, not a multiple of the store's {store.num_kv_heads} "
                "kv heads; pass all query heads of the layer.")
        require(q.is_floating_point(), ShapeError, f"q has dtype {q.dtype}; pass a float query.")
        require(store.num_tokens > 0, EmptyStoreError,
                "the store holds no tokens; append the prompt's keys and values before decoding.")

    # ------------------------------------------------------------ dense mode
    def _dense_step(self, q, store, scaling):
        out = self._dense_heads(q, store, torch.arange(q.shape[0], device=q.device), scaling)
        hq = q.shape[0]
        zeros = torch.zeros(hq, device=q.device)
        e_arith = self._dense_arith(self._arith_spec(q, store, scaling, None), q, store)
        cert = Certificate(
            candidate_e_key=zeros, candidate_e_val=zeros, e_key=zeros, e_val=zeros,
            e_arith=e_arith, delta=zeros,
            tail_mass=zeros, k_star=torch.full((hq,), store.num_blocks, device=q.device),
            rung=torch.full((hq,), 4, device=q.device), ranking_ok=zeros == 0,
            boundary_ok=zeros == 0, canary_ok=zeros == 0,
            value_blocks=torch.full((hq,), store.num_blocks, device=q.device),
            value_promotions=0, num_blocks=store.num_blocks, mode="dense")
        return out, cert

    @staticmethod
    def _dense_arith(spec: ArithSpec, q, store: TieredKVStore) -> torch.Tensor:
        """E_arith ``[Hq]`` of the dense path (device ops only)."""
        v_max = store.value_norm_max().repeat_interleave(q.shape[0] // store.num_kv_heads)
        return dense_arith(spec, store.num_tokens, q=q, key_abs_max=store.key_abs_max(),
                           v_max=v_max)

    def _dense_heads(self, q, store, heads, scaling):
        """Dense attention for query ``heads`` on their kv heads' FP16 originals (rungs 3-4)."""
        if heads.numel() == q.shape[0]:  # the whole layer: GQA inside SDPA, no gather
            k16, v16 = store.dense_kv()
            return self.backend.dense(q, k16, v16, scaling)
        kv_heads, gather = torch.unique(heads.cpu() // (q.shape[0] // store.num_kv_heads),
                                        return_inverse=True)  # host indices (after the read)
        k16, v16 = store.dense_kv(kv_heads)
        gather = gather.to(k16.device, non_blocking=True)
        return self.backend.dense(q[heads.to(q.device)], k16[gather], v16[gather], scaling)

    # -------------------------------------------------------- quantized modes
    def _quantized_step(self, q, store, scaling, scratch=None):
        """Naive and certified steps. With ``ladder.bound_tol`` / ``bound_rtol`` set, a head
        whose returned bound exceeds its tolerance escalates: the pass is redone with that head's
        key set at the ladder's cap, then also with FP16 values for its promoted blocks, then the
        head goes dense (:attr:`Certificate.tol_level` says how far each head went). The numba
        backend runs the default certified step as one compiled call (:meth:`_one_call`)."""
        timer = self.timer or NULL_TIMER
        tolerant = self.mode == "certified" and self.ladder.bound_tolerance
        on_device = self._on_device(q, tolerant)  # no host read: flags, and page-in if covered
        with timer.phase("layout"):
            lay = self._layout(store, on_device)
        hkv = store.num_kv_heads
        qg = q.float().reshape(hkv, q.shape[0] // hkv, -1)
        if numba_step.covers(self, q, store, on_device, tolerant):
            step, boost, e_drop = self._one_call(q, qg, lay, scaling, scratch, timer), None, None
            dense_heads = self._host_flags(step.flags)[0]
        else:
            step, boost, e_drop, dense_heads = self._passes(q, qg, store, lay, scaling, scratch,
                                                            timer, on_device, tolerant)
        with timer.phase("fallback"):
            if on_device:
                out, e_arith = self._fallback_on_device(q, store, step, scaling)
            else:
                out, e_arith = self._fallback(q, store, step.out, dense_heads, scaling,
                                              step.spec, step.e_arith)
        if e_drop is not None:  # naive eviction's dropped mass joins the returned E_key
            step.e_key = step.e_key + e_drop
            step.returned = _returned(step.rung, step.e_key, step.e_val)
        cert = step.certificate(e_arith, self.mode, boost)
        if store.protection.enabled:
            counts = store.fault_counts()
            cert.corrected_words = counts["corrected_words"]
            cert.erased_words = counts["erased_words"]
            cert.corrupted_blocks = counts["corrupted_blocks"]
            cert.faults_covered = store.protection.covers_faults
        return out, cert

    def _passes(self, q, qg, store, lay, scaling, scratch, timer, on_device, tolerant):
        """Phase 1 and the passes of a quantized step, phase by phase: one pass, or with a
        bound tolerance (``tolerant``) up to :data:`TOL_LEVELS` escalations of the heads over
        it (see :meth:`_quantized_step`). Returns ``(_Pass, boost [Hq] or None, e_drop [Hq] or
        None, dense heads)`` (the host indices of the heads for the host fallback; None on the
        device path)."""
        boost, dense_heads = None, None
        # Phase 1: INT8 logits, block log-masses, Delta_b (eq. 8).
        with timer.phase("phase1"):
            scored = self.backend.phase1(qg, lay, scaling)
        scored, e_drop = self._drop_evicted(q, store, lay, scored, scaling)
        if on_device and self.backend.pages_in_on_device(lay):
            pager = partial(self._page_in_on_device, scratch)
        else:  # the host stages from the scratch cache or straight from Tier-2
            pager = partial(self._page_in, partial(_tier2_stage, store) if scratch is None
                            else partial(scratch.stage, store),
                            None if scratch is None else partial(scratch.record, store))
        for _ in range(TOL_LEVELS):
            step = self._pass(q, qg, store, lay, scored, scaling, pager, boost, timer,
                              on_device)
            if e_drop is not None:
                _dense_where_unbounded(step, e_drop)
            if on_device:  # never tolerant: one pass
                break
            over = self.ladder.over_tolerance(step.bound, step.out.norm(dim=-1)) \
                if tolerant else None
            dense_heads, over_heads = self._host_flags(step.flags, over)
            if over_heads.numel() == 0:
                break
            boost = (torch.zeros(q.shape[0], dtype=torch.long, device=q.device)
                     if boost is None else boost)
            boost = torch.where(over, torch.clamp(boost + 1, max=TOL_LEVELS), boost)
        if tolerant and over_heads.numel():  # still over after the widest pass: dense
            over_dev = over_heads.to(q.device, non_blocking=True)
            boost[over_dev] = TOL_LEVELS
            step.rung = step.rung.clone()
            step.rung[over_dev] = step.rung[over_dev].clamp(min=3)
            step.returned = _returned(step.rung, step.e_key, step.e_val)
            dense_heads = torch.unique(torch.cat([dense_heads, over_heads]))
        return step, boost, e_drop, dense_heads

    def _one_call(self, q, qg, lay, scaling, scratch, timer) -> _Pass:
        """Phase 1 and one certified pass as one compiled call on the numba backend
        (:mod:`certkv.kernels.numba_step`: the phase-by-phase step's numbers, bit for bit); the
        scratch cache counts the FP16 blocks read from Tier-2 in place as :meth:`_page_in`
        has it do."""
        store = lay.store
        spec = self._arith_spec(q, store, scaling, lay)
        coef = step_coefficients(spec, lay.num_blocks, _counted_tokens(lay, False), q.device)
        with timer.phase("step"):
            f = numba_step.run(self, q, qg, lay, scaling, spec, coef)
        if scratch is not None:
            for which, mask in zip("kv", f.plan, strict=True):
                if mask.any():
                    scratch.record(store, mask, which)
        blocks = BlockStats(f.rho, lay.eta, f.delta_b, f.v_rad, lay.quantized)
        return _Pass(out=f.out, spec=spec, flags=f.flags, e_key=f.e_key, e_val=f.e_val,
                     e_arith=f.e_arith, delta=f.delta, tail_mass=f.tail_mass, k_star=f.k_star,
                     rung=f.rung, ranking=f.ranking, boundary=f.boundary, canary=f.canary,
                     value_blocks=f.value_blocks, value_promotions=int(f.plan[1].sum()),
                     num_blocks=lay.num_quantized, paper_key=f.paper_key,
                     paper_val=f.paper_val, blocks=blocks, returned=f.returned)

    def _layout(self, store: TieredKVStore, on_device: bool) -> StepLayout:
        """The step's layout: on the device path with the kernels running both phases, a tail
        block column always (empty right after a block completes), so that the launches change
        only when a block completes, and with :attr:`pad_layout` empty blocks up to the store's
        block capacity, so that they change only when its buffers grow (:meth:`graph_layout`)."""
        lay = StepLayout(store)
        if on_device and _takes_empty_tail(self.backend, lay):
            if self.pad_layout and store.num_blocks:
                return StepLayout(store, read=False, width=store.block_capacity())
            if not store.tail_len:
                lay = StepLayout(store, empty_tail=True, read=False)  # the words just checked
        return lay

    def graph_layout(self, store: TieredKVStore) -> tuple | None:
        """What a captured step over ``store`` depends on besides device memory (a graph is
        replayed while it stays the same, :mod:`certkv.graphs`): the store's buffers
        (:meth:`TieredKVStore.graph_signature`), whether it has completed blocks, the completed
        blocks themselves unless the layout is padded (:attr:`pad_layout`, where the kernels
        take an empty tail block) and, where they do not, whether the tail holds tokens; None
        for a store that is not graphable."""
        signature = store.graph_signature()
        if signature is None:
            return None
        known = self._empty_tail.get(store)
        if known is None or known[0] != signature:  # which precisions the kernels read changed
            known = signature, _takes_empty_tail(self.backend, StepLayout(store, read=False))
            self._empty_tail[store] = known
        takes_empty = known[1]
        padded = self.pad_layout and takes_empty
        return (signature, bool(store.num_blocks), None if padded else store.num_blocks,
                bool(store.tail_len) or takes_empty)

    def _drop_evicted(self, q, store, lay, scored, scaling):
        """Naive eviction, as kvpress does it: a naive step leaves evicted blocks out of
        attention (their Phase-1 scores masked: zero mass, no ``Delta_b``) and adds ``E_drop``
        (:mod:`certkv.certify.dropped`) to ``E_key`` for their mass, bounded from their Tier-1
        summaries' Phase-1 scores. Returns ``(scored, e_drop [Hq] or None)``; certified steps
        keep every block (summaries in the bound, page-in by the ladder)."""
        if self.mode != "naive" or store.evicted_pid is None:
            return scored, None
        evicted = store.evicted_mask()  # host
        if not bool(evicted.any()):
            return scored, None
        extra = torch.zeros(lay.num_blocks - evicted.numel(), dtype=torch.bool)
        dropped = torch.cat([evicted, extra]).to(store.device, non_blocking=True)
        hq, group = q.shape[0], q.shape[0] // store.num_kv_heads
        mass = dropped_mass(self._arith_spec(q, store, scaling, lay), q=q,
                            key_abs_max=store.key_abs_max(), l8=scored.log_mass.reshape(hq, -1),
                            delta_b=scored.delta_b.reshape(hq, -1), dropped=dropped,
                            n_tokens=store.num_tokens)
        v_rad = torch.minimum(lay.v_radius, lay.v_max).repeat_interleave(group)
        return without_blocks(scored, dropped), dropped_error(mass, v_rad)

    def _pass(self, q, qg, store, lay, scored, scaling, pager, boost, timer,
              on_device=False) -> _Pass:
        """Selection, page-in, Phase 2, checks and the certificate of one pass over the
        Phase-1 scores (``boost [Hq]``: the bound-tolerance escalation level per head, or
        None); the fallback is left to the caller (on the device path the certificate segment
        also returns every head's dense ``e_arith`` for it)."""
        hq, hkv = q.shape[0], store.num_kv_heads
        group = hq // hkv
        certified = self.mode == "certified"

        # Selection (paper 3.3), rung 1, value promotion (rung 2): device tensors only (on the
        # device path the quantized block count too, which changes in place as blocks complete)
        n_q = lay.quantized_count if on_device else lay.num_quantized
        with timer.phase("select"):
            draw = self.ladder.exploration_draw((hq, lay.quantized.numel()), q.device) \
                if certified else None
            kv_of = self._kv_of(hq, hkv, q.device)
            inputs = SelectInputs(
                qg=qg, l8_kv=scored.log_mass, delta_kv=scored.delta_b,
                log_spread_kv=_log_spread(scored), quantized=lay.quantized, eta=lay.eta,
                value_spec=lay.value_spec, key_err=lay.key_err, v_max_kv=lay.v_max,
                v_rad_kv=lay.v_radius, kv_of=kv_of, draw=draw, n_q=n_q, scaling=scaling,
                boost=boost)
            if self._fused_select(q.device, draw, boost, on_device):
                sel = fused_select.select(self.selector, self.ladder, self.value_policy, inputs)
            else:
                sel = self._segment("_select_step", q.device)(inputs)
            log_p, delta_b, delta, delta_chan = sel.log_p, sel.delta_b, sel.delta, sel.delta_chan
            v_max, v_rad, q_norm, promoted = sel.v_max, sel.v_rad, sel.q_norm, sel.promoted
            expanded, value_kv, plan, exact = sel.expanded, sel.value_kv, sel.plan, sel.exact

        # Page-in (on the host: the step's first host read; on the device: none) and Phase 2
        # (gated keys, FP16 values).
        with timer.phase("page_in"):
            keys, values, paged, promotions = (
                pager(lay, plan) if certified else (None, None, 0, 0))
        l8, lad = scored.log_mass.reshape(hq, -1), self.ladder
        checks = CheckInputs(l8, delta_b, promoted, lay.quantized, lad.r) \
            if certified and (lad.ranking_check or lad.boundary_check) else None
        with timer.phase("phase2"):
            att = self.backend.phase2(qg, scored, lay, promoted.reshape(hkv, group, -1), keys,
                                      values, scaling, lad.eps_guard, checks)

        # Ranking and boundary checks (eq. 17-18): Phase 2's epilogue, or one small call.
        l16 = att.log_mass.reshape(hq, -1)
        with timer.phase("checks"):
            ranking, boundary = self._rank_checks(checks, l16, att)

        # Certificate (eq. 15, Cor. 4.2), canary and rungs 3-4 (flags read by the caller).
        with timer.phase("certificate"):
            spec = self._arith_spec(q, store, scaling, lay, on_device)
            segment = self._certify_fused if self._fused_cpu(q.device, on_device) \
                else self._segment("_certify_step", q.device)
            coef = step_coefficients(spec, lay.num_blocks, _counted_tokens(lay, on_device),
                                     q.device)
            if self._compiler(q.device):  # no recompile when the counts change
                coef = as_tensors(coef, q.device)
            b = segment(CertifyInputs(
                l8=l8, l16=l16, rho=att.rho.reshape(hq, -1), spread=_spread(att).reshape(hq, -1),
                out=att.out.reshape(hq, -1), log_p=log_p, delta_b=delta_b, delta=delta,
                delta_chan=delta_chan, v_max=v_max, v_rad=v_rad, q_norm=q_norm,
                promoted=promoted, exact=exact, expanded=expanded, value_kv=value_kv,
                eta=lay.eta, value_spec=lay.value_spec, key_spec=lay.key_spec, ranking=ranking,
                boundary=boundary, canary_blocks=att.canary, q=q,
                kv_bad=store.nonfinite_appended(), key_abs_max=store.key_abs_max(),
                eta_max_kv=store.value_error_max(), kv_of=kv_of,
                v_max_kv=store.value_norm_max() if on_device else None), spec, coef)
        blocks = BlockStats(att.rho.reshape(hq, -1), lay.eta, delta_b, v_rad, lay.quantized)
        return _Pass(out=att.out.reshape(hq, -1), spec=spec, flags=b.flags, e_key=b.e_key,
                     e_val=b.e_val, e_arith=b.e_arith, delta=delta, tail_mass=b.tail_mass,
                     k_star=b.k_star, rung=b.rung, ranking=ranking, boundary=boundary,
                     canary=b.canary, value_blocks=b.value_blocks, value_promotions=promotions,
                     num_blocks=lay.num_quantized, paper_key=b.paper_key,
                     paper_val=b.paper_val, blocks=blocks, paged_evicted=paged,
                     returned=b.returned, e_final=b.e_final)

    def _kv_of(self, hq: int, hkv: int, device: torch.device) -> torch.Tensor:
        """``[Hq]`` int64 on ``device``: each query head's kv head (``x[kv_of]`` spreads a
        per-kv-head ``x`` over its query heads in one gather), made once per shape."""
        key = (hq, hkv, str(device))
        if key not in self._constants:
            self._constants[key] = torch.arange(hq, device=device) // (hq // hkv)
        return self._constants[key]

    def _segment(self, name: str, device: torch.device):
        """The pure tensor segment ``name``, compiled (fused kernels, one graph, dynamic
        shapes) when ``compile`` asks for it on this device, else the eager method. A segment
        that fails to compile warns once and runs eagerly from then on."""
        fn, backend = getattr(self, name), self._compiler(device)
        if backend is None:
            return fn
        if (name, backend) not in self._compiled:
            self._compiled[name, backend] = CompiledSegment(fn, backend)
        return self._compiled[name, backend]

    def _fused_cpu(self, device: torch.device, on_device: bool) -> bool:
        """Whether the certificate runs as fused CPU loop nests: ``compile=None`` on a CPU
        device with numba installed, unless the step's fallback runs on the device (the GPU's
        design: it needs the segment's final ``e_arith`` and never reads a tensor on the
        host)."""
        return (self.compile is None and device.type == "cpu" and not on_device
                and fused_cpu.AVAILABLE)

    def _fused_select(self, device: torch.device, draw, boost, on_device=False) -> bool:
        """Whether selection runs as one fused CPU loop nest: where the certificate does
        (:meth:`_fused_cpu`), on a certified step with the default policy
        (:func:`fused_select.covers`)."""
        return (self._fused_cpu(device, on_device) and self.mode == "certified"
                and fused_select.covers(self.selector, self.ladder, self.value_policy, draw,
                                        boost))

    def _compiler(self, device: torch.device) -> str | None:
        """The ``torch.compile`` backend of this device's segments, or None (eager)."""
        backend = self.compile
        if backend is None:
            backend = "inductor" if device.type == "cuda" else False
        if backend is False:
            return None
        return "inductor" if backend is True else backend

    def _select_step(self, x: SelectInputs) -> Selection:
        """Selection segment (pure tensor code, no host reads; compiled on GPU): paper 3.3's
        key set with rung 1, the value promotions (rung 2) and the page-in plan. ``x``:
        :class:`~certkv.certify.segment.SelectInputs` (``boost [Hq]``: bound-tolerance
        escalation level, 1: key set at the ladder's cap, 2: also FP16 values of the promoted
        blocks). Returns :class:`~certkv.certify.segment.Selection` (``delta_b`` tightened,
        :func:`tightened_deltas`; the plan: FP16 keys needed by any head of the kv head, FP16
        values; ``exact = ~quantized``: exact windows and the tail block).
        """
        (qg, l8_kv, delta_kv, log_spread_kv, quantized, eta, value_spec, key_err, v_max_kv,
         v_rad_kv, kv_of, draw, n_q, scaling, boost) = x
        hkv, group, n = l8_kv.shape
        hq = hkv * group
        exact = ~quantized
        l8 = l8_kv.reshape(hq, n)
        log_p = torch.log_softmax(l8, dim=-1)
        q_norm = torch.linalg.vector_norm(qg, dim=-1)
        delta_chan = delta_kv.reshape(hq, n)  # 0 on the exact tail block
        delta_b = tightened_deltas(delta_kv, q_norm, key_err, scaling).reshape(hq, n)
        delta = delta_b.amax(dim=-1)
        v_max, v_rad = torch.stack([v_max_kv, torch.minimum(v_rad_kv, v_max_kv)])[:, kv_of]
        certified = self.mode == "certified"
        promoted, expanded = self._select(log_p, quantized, exact, n_q, delta_b, delta,
                                          delta_chan, v_max, v_rad, group, certified, draw,
                                          boost)
        value_kv = self._value_promotion(log_p, eta, delta, log_spread_kv.reshape(hq, n) - (
            l8 - log_p), value_spec, hkv, certified)  # log-spread minus each head's log-sum-exp
        if boost is not None:  # level 2: FP16 values for the boosted heads' promoted blocks
            extra = promoted & quantized & (boost >= 2).unsqueeze(-1)
            value_kv = value_kv | (extra.reshape(hkv, group, n).any(dim=1) & (eta > 0))
        need_keys = promoted.view(hkv, group, n).any(dim=1) & quantized
        return Selection(log_p, delta_b, delta, delta_chan, v_max, v_rad, q_norm, promoted,
                         expanded, value_kv, torch.stack([need_keys, value_kv]), exact)

    def _certify_step(self, x: CertifyInputs, spec, coef) -> CertifyOutputs:
        """Certificate segment (pure tensor code; compiled on GPU): the tight E_key (eq. 15
        with the per-block TV bound and centred values) and E_val (Cor. 4.2 with the spectral
        block terms), E_arith of the quantized path (:mod:`certkv.certify.arith`), the paper's
        own terms (telemetry), the canary, the rungs, and the flags the host reads.

        The key bound is evaluated once over three lanes: as returned, in the paper's form
        (eq. 8's ``Delta_b``, no per-block cap) and at the inputs widened by their rounding
        (arith item 2), the per-block TV bound once over the first and the last.

        ``x``: the named inputs (:class:`~certkv.certify.segment.CertifyInputs`, shapes there);
        ``spec, coef``: the arithmetic bound's static facts and step coefficients. Returns
        :class:`~certkv.certify.segment.CertifyOutputs`: ``flags [Hq + 2]`` (heads needing
        dense attention, then non-finite ``q`` and non-finite appended K/V), ``returned``
        (E_key and E_val ``[Hq]`` as returned: 0 on rungs 3-4) and, given ``x.v_max_kv``, the
        step's final ``e_arith`` after the device fallback (dense heads: the dense path's,
        arith item 7; every head ``inf`` when ``q`` or the appended K/V are not finite; else
        None). A head whose output or bound is not finite, or whose output overflows the
        caller's dtype, goes dense (rung 3).
        """
        (l8, l16, rho, spread, out, log_p, delta_b, delta, delta_chan, v_max, v_rad, q_norm,
         promoted, exact, expanded, value_kv, eta, value_spec, key_spec, ranking, boundary,
         canary_blocks, q, kv_bad, key_abs_max, eta_max_kv, kv_of, v_max_kv) = x
        hq, n = l8.shape
        hkv = eta.shape[0]
        group = hq // hkv
        not_tail = promoted | exact  # off the INT8 tail
        # log-sum-exps over blocks: the tail's INT8 upper log-masses with the tight and with
        # eq. 8's Delta_b (U_T), the promoted blocks' FP16 log-mass (Z_F), the tail's estimate
        lse = torch.logsumexp(torch.stack([l8 + delta_b, l8 + delta_chan, l16, log_p]).masked_fill(
            torch.stack([not_tail, not_tail, ~promoted, not_tail]), NEG_INF), dim=-1)
        log_u, log_u_chan, log_z, log_alpha = lse.unbind()
        cap, cap_chan = tail_logit(torch.stack([log_u, log_u_chan]), log_z).unbind()
        d_tail = delta_b.masked_fill(not_tail, 0.0)
        delta_t, delta_t_chan, delta_chan_max = torch.stack(
            [d_tail, delta_chan.masked_fill(not_tail, 0.0), delta_chan]).amax(dim=-1)
        terms = logit_terms(spec, coef, q, key_abs_max, delta)
        # per-block TV bound (block_tv_bound) as returned and at the widened inputs, in FP64
        lam = logit_error_norms(q_norm, key_spec, spec.scaling).view(hq, n)
        rho64, spread64, d_tail64, lam64 = torch.stack([rho, spread, d_tail, lam]).double()
        widened = widened_blocks(coef, terms, rho64, spread64, delta_b.double(), lam64,
                                 not_tail)
        tv_block, tv_block_plus = block_tv_bound(*(torch.stack(pair) for pair in zip(
            (rho64, d_tail64, lam64, spread64), widened, strict=True))).unbind()
        # E_key (eq. 15 with both caps) in three lanes: returned, the paper's form (eq. 8's
        # Delta_b, no per-block cap; telemetry), and widened (arith item 2, without tanh(eps/2))
        wide = widened_key_inputs(terms, delta, delta_t, log_alpha, cap)
        e_key, paper_key, tv_plus = key_error_bound(
            torch.stack([v_rad, v_max, torch.full_like(v_max, 0.5)]),
            torch.stack([delta, delta_chan_max, wide[0]]),
            torch.stack([delta_t, delta_t_chan, wide[1]]),
            torch.stack([log_alpha, log_alpha, wide[2]]), self.selector.mass_inflation,
            torch.stack([cap, cap_chan, wide[3]]),
            torch.stack([tv_block, torch.full_like(tv_block, math.inf), tv_block_plus]))
        # E_val (Cor. 4.2 per block, tight and the paper's) over the blocks read quantized
        eta_q = eta.masked_fill(value_kv, 0.0).unsqueeze(1)  # [Hkv, 1, n]
        sigma_kv = value_spec.masked_fill(value_kv, 0.0)
        rho3, spread3 = rho.view(hkv, group, n), spread.view(hkv, group, n)
        e_val = value_error_bound_tight(rho3, eta_q, spread3, sigma_kv.unsqueeze(1)).view(hq)
        paper_val = value_error_bound(rho3, eta_q).view(hq)
        e_key, paper_key = e_key.float(), paper_key.float()
        e_arith = quantized_arith(
            coef, terms, tv_plus=tv_plus, v_max=v_max, v_rad=v_rad, eta_max=eta_max_kv[kv_of],
            sigma_max=sigma_kv.amax(dim=-1)[kv_of], e_key=e_key, e_val=e_val,
            out_norm=out.norm(dim=-1))
        value_blocks = value_kv.sum(dim=-1)[kv_of]
        canary, rung, flags = self._rungs(out, q, kv_bad, e_key + e_val + e_arith, expanded,
                                          value_blocks, ranking, boundary, canary_blocks)
        e_final = None if v_max_kv is None else _device_arith(
            flags, e_arith, dense_arith(spec, 0, q=q, key_abs_max=key_abs_max,
                                        v_max=v_max_kv[kv_of], acc_coef=coef.dense_acc))
        return CertifyOutputs(e_key, e_val, e_arith, log_alpha.exp(),
                              (promoted & ~exact).sum(dim=-1), canary, rung, value_blocks, flags,
                              paper_key, paper_val, _returned(rung, e_key, e_val), e_final)

    def _certify_fused(self, x: CertifyInputs, spec, coef) -> CertifyOutputs:
        """:meth:`_certify_step` with its arithmetic as one fused loop nest on CPU tensors
        (:func:`certkv.certify.fused_cpu.certificate`: same terms, same shapes, then the rungs,
        flags and returned bounds in one more, :func:`certkv.certify.fused_cpu.rungs`). Host
        fallback only (``v_max_kv`` None, ``e_final`` None): the device fallback's final
        ``e_arith`` is the PyTorch segment's (:meth:`_fused_cpu`)."""
        (e_key, e_val, e_arith, tail_mass, paper_key, paper_val, k_star, value_blocks, canary,
         rung, flags, returned) = fused_cpu.certificate(
            spec, coef, self.selector.mass_inflation, l8=x.l8, l16=x.l16, rho=x.rho,
            spread=x.spread, log_p=x.log_p, delta_b=x.delta_b, delta_chan=x.delta_chan,
            delta=x.delta, v_max=x.v_max, v_rad=x.v_rad, q_norm=x.q_norm, promoted=x.promoted,
            exact=x.exact, value_kv=x.value_kv, eta=x.eta, value_spec=x.value_spec,
            key_spec=x.key_spec, q=x.q, key_abs_max=x.key_abs_max, eta_max_kv=x.eta_max_kv,
            out=x.out, rung_inputs=fused_cpu.RungInputs(
                self.ladder, self.mode == "certified", x.expanded, x.ranking, x.boundary,
                x.canary_blocks, x.kv_bad))
        return CertifyOutputs(e_key, e_val, e_arith, tail_mass, k_star, canary, rung,
                              value_blocks, flags, paper_key, paper_val, returned, None)

    def _rungs(self, out, q, kv_bad, bound, expanded, value_blocks, ranking, boundary,
               canary_blocks):
        """The canary ``[Hq]``, each head's rung ``[Hq]`` and the flags ``[Hq + 2]`` (heads
        needing dense attention, non-finite ``q``, non-finite appended K/V). A head whose
        output or ``bound`` is not finite (a NaN compares false), or whose output overflows
        the caller's dtype, goes dense (rung 3); ``torch.where``, not masked writes: no device
        sync."""
        certified = self.mode == "certified"
        canary = ~canary_blocks.flatten(0, 1).any(dim=-1)
        if not (certified and self.ladder.canary):
            canary = torch.ones_like(canary)
        finite = (out.to(q.dtype).abs().amax(dim=-1) < math.inf) & (bound < math.inf)
        rung = torch.maximum(expanded.long(), (value_blocks > 0) * 2)
        rung = torch.where((ranking & boundary & finite) if certified else finite, rung, 3)
        if certified:
            rung = torch.where(self.ladder.layer_dense(rung >= 3, canary), 4, rung)
        bad = torch.stack([~(q.abs().amax() < math.inf), kv_bad])
        return canary, rung, torch.cat([rung >= 3, bad])

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

    def _select(self, log_p, quantized, exact, n_q, delta_b, delta, delta_chan, v_max, v_rad,
                group, certified, draw, boost=None):
        """FP16-key set ``[Hq, n]`` (exact tail block always in) and the rung-1 flag ``[Hq]``."""
        hq = log_p.shape[0]
        if not certified:
            return exact.expand(hq, -1), torch.zeros(hq, dtype=torch.bool, device=exact.device)
        sel = self.selector
        p = log_p.exp()
        order = sel.order(p, delta_b, quantized)
        rank = sel.ranks(order)
        k = sel.choose_k(p, quantized, order, n_q)
        promoted = sel.promoted(rank, k, exact, group)
        if self.ladder.tail_mass == "paper":
            tail_bound, e_key = self._paper_tail(log_p, promoted, delta_chan, v_max)
        else:
            tail_bound, e_key = self._tight_tail(log_p, quantized, promoted, delta_b, delta,
                                                 v_rad)
        need = self.ladder.needs_expansion(tail_bound, sel.tau_cov, e_key)
        k_new = torch.where(need, self.ladder.expanded_k(k, sel.k_max, n_q), k)
        if boost is not None:  # bound-tolerance escalation: the widest key set the ladder allows
            cap = self.ladder.key_cap(sel.k_max, n_q)
            k_new = torch.where(boost >= 1, k_new.clamp(min=cap), k_new)
        expanded = k_new > k
        promoted = sel.promoted(rank, k_new, exact, group)  # all tensor ops, no host sync
        if draw is not None:
            promoted = promoted | exploration_mask(quantized & ~promoted, draw,
                                                   self.ladder.exploration)
        return promoted, expanded

    def _paper_tail(self, log_p, promoted, delta_chan, v_max):
        """Rung 1's tail mass as in the paper, eq. 14's ``e^{c Delta} alpha_hat`` with eq. 8's
        channel ``Delta_b``, and the candidate E_key (eq. 15) when ``ladder.e_key_tol`` asks
        for it, else None (``[Hq]`` each). Exact blocks are among the ``promoted``."""
        c = self.selector.mass_inflation
        delta = delta_chan.amax(dim=-1)
        if self.ladder.e_key_tol is None:
            log_alpha = torch.logsumexp(log_p.masked_fill(promoted, NEG_INF), dim=-1)
            return tail_mass_bound(log_alpha, delta, c), None
        log_alpha, _, e_key = _key_bound(log_p, ~promoted, delta_chan, delta, v_max, c)
        return tail_mass_bound(log_alpha, delta, c), e_key

    def _tight_tail(self, log_p, quantized, promoted, delta_b, delta, v_rad):
        """Rung 1's tail mass, tight, and the candidate E_key when ``ladder.e_key_tol`` asks for
        it, else None (``[Hq]`` each). Exact blocks are among the ``promoted``.

        Phase 2 changes only the promoted blocks' logits, each by at most its ``Delta_b``, so
        with ``Delta_F`` the largest of them its tail mass is at most ``min(1, e^{Delta_F}
        alpha_hat)`` and each tail block's mass at most ``min(1, e^{Delta_F} p_hat_b)``
        (``Z_F' >= e^{-Delta_F} Z_F``); E_key is then the per-block TV bound with those masses
        (:func:`~certkv.certify.bounds.block_tv_bound`) and the centred radius.
        """
        not_promoted = ~promoted
        delta_f = delta_b.masked_fill(not_promoted, 0.0).amax(dim=-1)  # 0 on exact blocks
        log_alpha = torch.logsumexp(log_p.masked_fill(promoted, NEG_INF), dim=-1)
        # min(1, e^{Delta_F} alpha_hat); NaN (not above any threshold) only for inf - inf,
        # where no tail is left: like 0, never expands
        bound = torch.exp((delta_f + log_alpha).clamp(max=0.0))
        if self.ladder.e_key_tol is None:
            return bound, None
        tail = quantized & not_promoted
        rho_ub = torch.exp((delta_f.unsqueeze(-1) + log_p).clamp(max=0.0))
        tv = block_tv_bound(_on(tail, rho_ub), _on(tail, delta_b))
        _, _, e_key = _key_bound(log_p, tail, delta_b, delta, v_rad,
                                 self.selector.mass_inflation, tv_cap=tv)
        return bound, e_key

    def _value_promotion(self, log_p, eta, delta, log_spread, value_spec, hkv, certified):
        """Blocks read with FP16 values, per kv head ``[Hkv, n]`` (the union of its query
        heads'): the value policy sees ``[Hkv, G, n]`` views, the per-kv-head ``eta`` and
        ``value_spec`` broadcast over the group; only blocks with a value error (``eta > 0``:
        quantized ones) can be promoted."""
        if not certified:
            return torch.zeros_like(eta, dtype=torch.bool)
        hq, n = log_p.shape
        grouped = (hkv, hq // hkv, n)
        eta_g = eta.unsqueeze(1)
        chosen = self.value_policy.select(log_p.view(grouped), eta_g, delta.view(hkv, -1),
                                          log_spread=log_spread.view(grouped),
                                          sigma=value_spec.unsqueeze(1))
        return (chosen & (eta_g > 0)).any(dim=1)

    def _page_in(self, stage, record, lay, plan):
        """Stage the FP16 keys and values the ``plan [2, Hkv, n]`` asks for (``stage``: the
        scratch cache, read in place by the kernels, or Tier-2). A backend that reads FP16 keys
        or values from the originals in place (its ``in_place``: keys for the PyTorch reference,
        both on the numba backend, where Tier-2 is the same memory) gets those blocks without
        data, and the scratch cache only counts them (``record``).

        The plan is read to the host once (the step's first host read: Tier-2 lives in host
        memory, so the host must know what to copy). Returns two :class:`StagedBlocks` (or
        None), the exact tail block never staged, how many (kv head, block) pairs of evicted
        blocks were paged in and how many value blocks were promoted.
        """
        staged = []
        store = lay.store
        dev, host = store.device, to_host(plan)
        paged = int(_paged_evicted(store, host))
        in_place = self.backend.in_place(store)
        for which, mask in zip(("k", "v"), host, strict=True):
            kv_idx, blk_idx = mask.nonzero(as_tuple=True)  # host tensors
            if kv_idx.numel() == 0:
                staged.append(None)
                continue
            if which in in_place:
                if record is not None:
                    record(mask, which)
                data, rows = None, None
            else:
                data, rows = stage(kv_idx, blk_idx, which)
            staged.append(StagedBlocks(kv_idx.to(dev, non_blocking=True),
                                       blk_idx.to(dev, non_blocking=True), data, rows))
        promotions = 0 if staged[1] is None else staged[1].blocks.numel()
        return staged[0], staged[1], paged, promotions

    _slot_maps = staticmethod(slot_maps)  # device page-in with its LRU bookkeeping, a segment

    def _page_in_on_device(self, scratch, lay, plan):
        """:meth:`_page_in` without a host read: slot maps built on the device in one segment
        (:func:`~certkv.cache.device_scratch.slot_maps`), through the scratch cache's device
        bookkeeping (misses of keys and values copied from Tier-2 by one kernel, blocks without
        a free slot read by Phase 2 from Tier-2 in place) or, without a scratch cache, every wanted
        block read from Tier-2 in place. Counts stay on the device (0-d)."""
        store = lay.store
        if lay.num_completed == 0:
            return None, None, 0, 0
        k2, v2, width = store.original_rows()
        lrus = [None if scratch is None else scratch.device_lru(which) for which in "kv"]
        tables = [None if lru is None else lru.tables(store, lay.num_blocks) for lru in lrus]
        maps, promotions, *steps = self._segment("_slot_maps", store.device)(
            plan, width, *tables)
        if scratch is None:
            pools = [self._no_pool(store)] * 2
        else:  # the tables updated in place: fill both pools' new slots in one launch
            from certkv.kernels.triton_pagein import fill_slots

            fill_slots([(need, src, tier2, lru.pool) for lru, (_, need, src), tier2
                        in zip(lrus, steps, (k2, v2), strict=True)])
            pools = [lru.pool for lru in lrus]
        return (SlotMap(maps[0], pools[0]), SlotMap(maps[1], pools[1]),
                _paged_evicted(store, plan), promotions)

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
        require(not bad[0], NonFiniteError, _NONFINITE_Q)
        require(not bad[1], NonFiniteError, NONFINITE_KV)
        over = flags[hq + 2:] & ~dense if over is not None else dense[:0]
        return dense.nonzero(as_tuple=True)[0], over.nonzero(as_tuple=True)[0]

    def _on_device(self, q, tolerant) -> bool:
        """Whether rungs 3-4 run on the device from the flags in place (``device_fallback``)."""
        possible = (self.backend.falls_back_on_device and q.dtype != torch.float64
                    and not tolerant)
        if self.device_fallback is None:
            return possible
        require(possible or not self.device_fallback, ConfigError,
                "device_fallback=True needs backend=triton, a query in FP32 or lower precision "
                "and no ladder.bound_tol / bound_rtol; use device_fallback=null.")
        return self.device_fallback

    def _fallback_on_device(self, q, store, step: _Pass, scaling):
        """Rungs 3-4 without a host read: the backend's one-launch kernel writes dense
        attention into the flagged heads' rows (``step.flags [Hq + 2]``), ``e_arith`` takes the
        kernel's own rounding chain there and a step with non-finite ``q`` or appended K/V gets
        ``e_arith = inf`` (an invalid certificate; ``step.e_final``, computed in the certificate
        segment: :func:`_device_arith`, arith item 7) and is remembered for
        :meth:`synchronize`."""
        hq = q.shape[0]
        bad = step.flags[hq:]
        out = self.backend.dense_flagged(q, step.flags[:hq], store, step.out.contiguous(),
                                         scaling)  # written in place: the pass's own output
        self._nonfinite_flags(bad.device).logical_or_(bad)  # in place: replays accumulate
        return out.to(q.dtype), step.e_final

    def _nonfinite_flags(self, device: torch.device) -> torch.Tensor:
        """bool ``[2]`` on ``device``: non-finite ``q``, appended K/V since the last
        :meth:`synchronize` (one tensor, updated in place, so that steps captured in a graph
        set it too; made outside inference mode so that either mode may clear it)."""
        if self._nonfinite is None or self._nonfinite.device != device:
            with torch.inference_mode(False):
                self._nonfinite = torch.zeros(2, dtype=torch.bool, device=device)
        return self._nonfinite

    def synchronize(self) -> None:
        """Raise the non-finite inputs of the steps since the last call (one host read), as
        the steps themselves do where the fallback reads its flags on the host."""
        if self._nonfinite is None:
            return
        bad_q, bad_kv = to_host(self._nonfinite).tolist()  # (on a CPU: the tensor itself)
        self._nonfinite.zero_()
        require(not bad_q, NonFiniteError, _NONFINITE_Q)
        require(not bad_kv, NonFiniteError, NONFINITE_KV)

    def _fallback(self, q, store, out, heads, scaling, spec, e_arith):
        """The FP32 output cast to ``q``'s dtype, with rungs 3-4 (dense attention on the FP16
        originals) written in for the query ``heads`` (host indices), and ``e_arith`` with the
        dense path's bound on those heads."""
        out = out.to(q.dtype)
        if heads.numel() == 0:
            return out, e_arith
        out = out.clone() if out.dtype == torch.float32 else out
        dev_heads = heads.to(out.device, non_blocking=True)
        out[dev_heads] = self._dense_heads(q, store, heads, scaling)
        e_arith = e_arith.clone()
        e_arith[dev_heads] = self._dense_arith(spec, q, store)[dev_heads]
        return out, e_arith


def max_scaling(head_dim: int) -> float:
    """The largest softmax scale certkv honours: every logit it computes, ``scaling q.k`` with
    ``q`` prescaled to ``|q|_inf <= 1`` on the dense path and FP16 keys (``|k| <= 65504``), stays
    finite in FP32 (``scaling * head_dim * 65504 < 2^128``); beyond it the dense path itself would
    overflow (4.1e31 at d=128; models use ``head_dim**-0.5``)."""
    return float(torch.finfo(torch.float32).max) / (head_dim * 65504.0) / 2


def _scaling(head_dim: int, scaling) -> float:
    """The caller's softmax scale as a float (``None``: ``head_dim**-0.5``); a 0-d tensor or
    array is read as its value; anything else that is not a finite positive number up to
    :func:`max_scaling` is a :class:`ConfigError` naming the fix."""
    if scaling is None:
        return head_dim**-0.5
    if isinstance(scaling, torch.Tensor | np.ndarray) and scaling.ndim == 0 \
            and scaling.dtype != bool and not isinstance(scaling, torch.BoolTensor):
        scaling = scaling.item()
    fix = "pass the model's softmax scale (usually head_dim**-0.5) as a float, or None"
    require(isinstance(scaling, numbers.Real) and not isinstance(scaling, bool)
            and math.isfinite(scaling) and scaling > 0,
            ConfigError, f"scaling={scaling!r} must be a finite positive number; {fix}.")
    limit = max_scaling(head_dim)
    require(scaling <= limit, ConfigError,
            f"scaling={scaling:.3g} exceeds {limit:.3g}, the largest scale whose logits FP32 "
            f"can hold at head_dim {head_dim}; {fix}.")
    return float(scaling)


def _device_arith(flags, e_arith, e_dense):
    """``[Hq]`` e_arith of a step whose fallback runs on the device (``flags [Hq + 2]``):
    the dense path's ``e_dense`` on flagged heads, ``inf`` everywhere when ``q`` or the
    appended K/V are not finite (an invalid certificate)."""
    hq = e_arith.shape[0]
    e_arith = torch.where(flags[:hq], e_dense, e_arith)
    return torch.where(flags[hq:].any(), math.inf, e_arith)


def _takes_empty_tail(backend, lay: StepLayout) -> bool:
    """Whether ``backend``'s phases take a tail block with no token (the Triton kernels')."""
    return backend.takes_empty_tail(lay)


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


def _paged_evicted(store: TieredKVStore, plan: torch.Tensor) -> torch.Tensor | int:
    """Evicted (kv head, block) pairs the page-in ``plan [2, Hkv, n]`` (on the host or the
    device) reads from Tier-2: a 0-d tensor on the plan's device (0 without eviction)."""
    if store.evicted_pid is None:
        return 0
    evicted = store.evicted_mask().to(plan.device, non_blocking=True)  # [completed blocks]
    return (plan[:, :, : evicted.numel()].any(dim=0) & evicted).sum()


def _tier2_stage(store: TieredKVStore, kv_heads, blocks, which: str):
    """Stage ``which`` (``"k"`` or ``"v"``) blocks straight from Tier-2: ``(data, None)``."""
    k, v = store.fetch_originals(kv_heads, blocks, which=which)
    return (k if which == "k" else v), None


def to_host(x: torch.Tensor) -> torch.Tensor:
    """Every device-to-host read of a decode step goes through here (at most two per step:
    the page-in plan and the fallback flags); tests count the calls."""
    return x.to("cpu")
