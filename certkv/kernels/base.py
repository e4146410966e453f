"""What the certified step asks of a backend (vLLM's ``AttentionBackend`` pattern): the phases
it must compute, and the capabilities the step asks about instead of asking for a type.

A backend implements Phase 1 (INT8 scores, eq. 7), Phase 2 (the selected blocks' attention,
eqs. 12-14), the ranking and boundary checks (eqs. 17-18), dense attention and the rounding
chain of its own arithmetic (arith item 4). Everything else has a default here that a backend
overrides where it can do more: read FP16 originals in place, page in on the device, take an
empty tail block, run a whole step as one fused call, recompute dense heads on the device.
Backends register by name (:data:`certkv.registry.BACKENDS`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class Backend(ABC):
    """Base class of attention backends (:class:`~certkv.kernels.reference.TorchBackend`, the
    numba and Triton backends)."""

    name: str = "backend"

    # ---------------------------------------------------------------- what every backend computes
    @abstractmethod
    def phase1(self, q, lay, scaling):
        """Scores of every block from its quantized keys (``Scored``; paper eq. 7)."""

    @abstractmethod
    def phase2(self, q, scored, lay, gate, staged, scaling, eps_guard, checks=None):
        """Attention over the blocks (``Attended``; eqs. 12-14), FP16 keys where ``gate``;
        ``staged``: the paged-in FP16 ``(keys, values)``, each staged blocks, a slot map or
        None. A backend whose :meth:`certifies_in_phase2` says so also takes ``certify=``."""

    @abstractmethod
    def checks(self, l_int8, l_fp16, delta_b, promoted, quantized, r):
        """Ranking (eq. 17) and boundary (eq. 18) flags ``[Hq]``."""

    @abstractmethod
    def dense(self, q, k, v, scaling):
        """Dense attention ``[Hq, d]`` over FP16 ``k, v [Hkv, N, d]`` (rungs 3-4)."""

    @abstractmethod
    def rounding(self, lay):
        """The rounding chain of this backend's Phase 2 (``Rounding``, arith item 4)."""

    # ---------------------------------------------------------------- capabilities and defaults
    def in_place(self, store) -> str:
        """Which FP16 originals Phase 2 reads from Tier-2 itself rather than from staged
        blocks: ``"k"`` (keys), ``"kv"`` (both) or ``""``."""
        return "k"

    def decoded_mirror(self, device: torch.device) -> bool | str:
        """What a store this backend attends on ``device`` keeps decoded (the
        ``decoded_mirror`` of :class:`~certkv.cache.store.TieredKVStore`)."""
        return device.type == "cpu"

    def pages_in_on_device(self, lay) -> bool:
        """Whether this step's page-in plan and scratch bookkeeping stay on the device."""
        return False

    def takes_empty_tail(self, lay) -> bool:
        """Whether the phases take a tail block with no token (a padded layout, graphs)."""
        return False

    def select(self, selector, ladder, value_policy, x):
        """The default policy's selection (:func:`certkv.certify.fused_select.covers`) in this
        backend's kernels (:class:`~certkv.certify.segment.Selection`), or None where it has
        none for this step (the caller runs the selection segment)."""
        return None

    def certifies_in_phase2(self, lay) -> bool:
        """Whether :meth:`phase2` takes ``certify=`` (a
        :class:`~certkv.kernels.triton_certify.CertifyRequest`) and computes the certificate in
        its merge, leaving the rungs to :meth:`dense_flagged` (``finish=``): a device step
        without the certificate segment."""
        return False

    def steps_batch_on_device(self, lays) -> bool:
        """Whether a batch's certified device step over these layouts (one per sequence) runs
        each stage as one launch over every sequence (:mod:`certkv.batch_step`): the
        ``*_batch`` methods of :class:`~certkv.kernels.triton_backend.TritonBackend`."""
        return False

    def fuses_step(self, device: torch.device) -> bool:
        """Whether a whole default step on ``device`` can run as one fused call
        (:mod:`certkv.kernels.numba_step`)."""
        return False

    @property
    def falls_back_on_device(self) -> bool:
        """Whether :meth:`dense_flagged` recomputes flagged heads on the device (rungs 3-4
        without a host read)."""
        return False

    def dense_rows(self, q, heads, store, scaling):
        """Dense attention ``[m, d]`` of the query ``heads [m]`` (indices) of ``q [Hq, d]``
        over the store's FP16 originals read in place, in the host fallback's rounding chain
        (:func:`~certkv.kernels.reference.dense_rounding`); None, at no cost, where this
        backend does not (the caller gathers the originals for :meth:`dense`)."""
        return None

    def dense_flagged(self, q, flags, store, out, scaling, finish=None):
        """Dense attention written into the rows of ``out`` whose ``flags`` are set (with
        ``finish``: the rungs of a certificate from :meth:`phase2` decided first)."""
        raise NotImplementedError(f"the {self.name} backend has no device fallback")

    def fallback_rounding(self, store):
        """The rounding chain of :meth:`dense_flagged`."""
        raise NotImplementedError(f"the {self.name} backend has no device fallback")
