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

import functools
import math
import numbers
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from certkv.batch_step import BatchedStep
from certkv.cache.scratch import ScratchCache
from certkv.cache.store import TieredKVStore
from certkv.certify.arith import ArithSpec
from certkv.certify.audit import violations
from certkv.certify.certificate import Certificate
from certkv.certify.ladder import Ladder
from certkv.certify.select import AdaptiveTopK
from certkv.certify.values import LocalThreshold
from certkv.errors import ConfigError, EmptyStoreError, NonFiniteError, ShapeError, require
from certkv.kernels.dispatch import get_backend
from certkv.kernels.layout import StepLayout
from certkv.step import NONFINITE_Q
from certkv.timing import PhaseTimer

MODES = ("certified", "naive", "dense")


@dataclass
class CertifiedAttention(BatchedStep):
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
        self._constants: dict = {}  # per-shape constants: kv_of (_kv_of), _no_pool; one_call
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
        return self._step(q, store, _scaling(store.head_dim, scaling), scratch)

    def _step(self, q, store, scaling: float, scratch) -> tuple[torch.Tensor, Certificate]:
        """A checked step (:meth:`__call__`) at the softmax scale ``scaling``."""
        q_dev = q.to(store.device)
        if self.mode == "dense":  # the baseline: no host reads on accelerators, as plain SDPA
            if store.device.type == "cpu":
                require(bool(torch.isfinite(q).all()), NonFiniteError, NONFINITE_Q)
            out, cert = self._dense_step(q_dev, store, scaling)
        else:
            out, cert = self._quantized_step(q_dev, store, scaling, scratch)
        if self.audit:
            k, v = store.dense_kv()
            violated, error = violations(out, cert.bound, q_dev, k, v, scaling)
            cert.violations, cert.error = int(violated.sum()), error.float()
            cert.audited = True
        return out, cert

    def batch(self, q: torch.Tensor, stores: Sequence[TieredKVStore],
              scaling: float | None = None, scratches: Sequence | None = None
              ) -> tuple[torch.Tensor, list[Certificate]]:
        """One decode step of a batch of sequences, each on its own store.

        ``q [B, Hq, d]`` (row ``b``: sequence ``b``'s queries) against ``stores[b]``, each with
        its own blocks, tail, tiers, eviction, protection and Tier-2 originals (and, optional,
        ``scratches[b]``) -> ``(out [B, Hq, d], certificates)``, certificate ``b`` that
        sequence's own (``cert.sequence == b``). Rungs are decided per (sequence, head): a
        fallback in one sequence never makes another dense, and no padding enters a sequence's
        attention, mass or bound (a store holds its own sequence's tokens only, whatever their
        number). Each sequence gets the output and certificate it gets stepped alone, bit for
        bit; a sequence that finishes leaves the batch by leaving the list (no other store is
        copied).
        """
        self._check_batch(q, stores, scratches)
        scaling = _scaling(stores[0].head_dim, scaling)  # one for the batch
        for b, store in enumerate(stores):
            self._check(q[b], store)
        lays = self._batch_layouts(q, stores, scratches)
        if lays is not None:  # every stage one launch over the batch (batch_step)
            return self._device_batch(q, lays, scaling, scratches)
        outs, certs = [], []
        for b, store in enumerate(stores):
            out, cert = self._step(q[b], store, scaling,
                                   None if scratches is None else scratches[b])
            cert.sequence = b
            outs.append(out)
            certs.append(cert)
        return torch.stack(outs), certs

    def _check_batch(self, q, stores, scratches) -> None:
        require(isinstance(q, torch.Tensor) and q.dim() == 3, ShapeError,
                "a batch's q must be a 3-D tensor [batch, num_query_heads, head_dim]; step one "
                "sequence with attention(q, store).")
        require(len(stores) == q.shape[0] > 0, ShapeError,
                f"q holds {q.shape[0]} sequences but {len(stores)} stores were passed; pass one "
                "store per sequence, in q's order.")
        require(scratches is None or len(scratches) == len(stores), ShapeError,
                f"{len(scratches or ())} scratch caches for {len(stores)} stores; pass one per "
                "sequence or none.")
        first = stores[0]
        for b, store in enumerate(stores[1:], start=1):
            same = (store.num_kv_heads, store.head_dim, store.device) == (
                first.num_kv_heads, first.head_dim, first.device)
            require(same and store.quantizer == first.quantizer, ConfigError,
                    f"sequence {b}'s store differs from sequence 0's in shape, device or "
                    f"quantizer ({store.quantizer.label} vs {first.quantizer.label}); a batch "
                    "decodes sequences of one config: build every store from the same one.")

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
            known = signature, self.backend.takes_empty_tail(StepLayout(store, read=False))
            self._empty_tail[store] = known
        takes_empty = known[1]
        padded = self.pad_layout and takes_empty
        return (signature, bool(store.num_blocks), None if padded else store.num_blocks,
                bool(store.tail_len) or takes_empty)

    def _check(self, q: torch.Tensor, store: TieredKVStore) -> None:
        """``q [Hq, d]`` a float query of ``store``'s head size and a multiple of its kv heads,
        and ``store`` not empty; else one sentence naming the fix (built only then: a decode
        step checks every layer)."""
        if not (isinstance(q, torch.Tensor) and q.dim() == 2):
            raise ShapeError("q must be a 2-D tensor [num_query_heads, head_dim] for one decode "
                             "step; squeeze batch and time dimensions first.")
        if q.shape[1] != store.head_dim:
            raise ShapeError(f"q has head_dim {q.shape[1]} but the store holds head_dim "
                             f"{store.head_dim}.")
        if not (q.shape[0] % store.num_kv_heads == 0 and q.shape[0] > 0):
            raise ShapeError(f"q has {q.shape[0]} heads, not a multiple of the store's "
                             f"{store.num_kv_heads} kv heads; pass all query heads of the layer.")
        if not q.is_floating_point():
            raise ShapeError(f"q has dtype {q.dtype}; pass a float query.")
        if store.num_tokens <= 0:
            raise EmptyStoreError("the store holds no tokens; append the prompt's keys and values "
                                  "before decoding.")

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

@functools.cache
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
    if type(scaling) is float and 0.0 < scaling <= max_scaling(head_dim):  # what models pass
        return scaling
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

