"""Rungs 3-4 of the quantized step (:mod:`certkv.step`): dense attention over the FP16
originals for the heads the certificate or the checks send there, on the host
(:meth:`Fallback._fallback`) or without a host read on the device
(:meth:`Fallback._fallback_on_device`), with the dense path's arithmetic bound, and the deferred
non-finite checks of the device path (:meth:`Fallback.synchronize`).

:class:`Fallback` is a base class of :class:`~certkv.step.QuantizedStep`: it holds no state of
its own and reads the attention's ``backend``, ``device_fallback`` and ``_nonfinite``. Shapes:
``q [Hq, d]``; per-head tensors ``[Hq]``.
"""

from __future__ import annotations

import torch

from certkv.cache.store import TieredKVStore
from certkv.certify.arith import ArithSpec, dense_arith
from certkv.certify.certificate import Certificate
from certkv.certify.step_certify import StepPass
from certkv.errors import ConfigError, require

NONFINITE_Q = "q holds NaN or Inf; check the model's activations before attention."


class Fallback:
    """Rungs 3-4 and the device path's deferred checks (see the module)."""

    @staticmethod
    def _dense_arith(spec: ArithSpec, q, store: TieredKVStore) -> torch.Tensor:
        """E_arith ``[Hq]`` of the dense path (device ops only)."""
        v_max = store.value_norm_max().repeat_interleave(q.shape[0] // store.num_kv_heads)
        return dense_arith(spec, store.num_tokens, q=q, key_abs_max=store.key_abs_max(),
                           v_max=v_max)

    def _dense_heads(self, q, store, heads, scaling):
        """Dense attention for query ``heads`` (host indices) on their kv heads' FP16
        originals (rungs 3-4): read in place where the backend can
        (:meth:`~certkv.kernels.base.Backend.dense_rows`), else gathered."""
        out = self.backend.dense_rows(q, heads, store, scaling)
        if out is not None:
            return out.to(q.dtype)
        if heads.numel() == q.shape[0]:  # the whole layer: GQA inside SDPA, no gather
            k16, v16 = store.dense_kv()
            return self.backend.dense(q, k16, v16, scaling)
        kv_heads, gather = torch.unique(heads.cpu() // (q.shape[0] // store.num_kv_heads),
                                        return_inverse=True)  # host indices (after the read)
        k16, v16 = store.dense_kv(kv_heads)
        gather = gather.to(k16.device, non_blocking=True)
        return self.backend.dense(q[heads.to(q.device)], k16[gather], v16[gather], scaling)

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

    def _fallback_on_device(self, q, store, step: StepPass, scaling):
        """Rungs 3-4 without a host read: the backend's one-launch kernel writes dense
        attention into the flagged heads' rows (``step.flags [Hq + 2]``), ``e_arith`` takes the
        kernel's own rounding chain there and a step with non-finite ``q`` or appended K/V gets
        ``e_arith = inf`` (an invalid certificate; ``step.cert.e_final``, from the certificate
        segment: :func:`~certkv.certify.step_certify.device_arith`, arith item 7) and is
        remembered for :meth:`synchronize`. Where Phase 2's merge computed the certificate
        (``step.pending``), the same launch decides the rungs first (rung 4, flags, returned
        bounds, ``e_final``) and returns the output in ``q``'s dtype."""
        hq = q.shape[0]
        seen = self._nonfinite_flags(q.device)  # in place: replays accumulate
        if step.pending is not None:  # the rungs first, in the same launch
            certified, finished = step.pending
            out = self.backend.dense_flagged(q, None, store, step.out.contiguous(), scaling,
                                             finish=(certified, finished, seen))
            return out, finished.e_final
        bad = step.flags[hq:]
        out = self.backend.dense_flagged(q, step.flags[:hq], store, step.out.contiguous(),
                                         scaling)  # written in place: the pass's own output
        seen.logical_or_(bad)
        return out.to(q.dtype), step.cert.e_final

    def _nonfinite_flags(self, device: torch.device) -> torch.Tensor:
        """bool ``[2]`` on ``device``: non-finite ``q``, appended K/V since the last
        :meth:`synchronize` (one tensor, updated in place, so that steps captured in a graph
        set it too; made outside inference mode so that either mode may clear it)."""
        if self._nonfinite is None or self._nonfinite.device != device:
            with torch.inference_mode(False):
                self._nonfinite = torch.zeros(2, dtype=torch.bool, device=device)
        return self._nonfinite

    def _fallback(self, q, store, step: StepPass, heads, scaling):
        """The pass's FP32 output cast to ``q``'s dtype, with rungs 3-4 (dense attention on the
        FP16 originals) written in for the query ``heads`` (host indices), and its ``e_arith``
        with the dense path's bound on those heads."""
        out, e_arith, spec = step.out.to(q.dtype), step.cert.e_arith, step.spec
        if heads.numel() == 0:
            return out, e_arith
        out = out.clone() if out.dtype == torch.float32 else out
        dev_heads = heads.to(out.device, non_blocking=True)
        out[dev_heads] = self._dense_heads(q, store, heads, scaling)
        e_arith = e_arith.clone()
        e_arith[dev_heads] = self._dense_arith(spec, q, store)[dev_heads]
        return out, e_arith


def record_faults(cert: Certificate, store: TieredKVStore) -> None:
    """The store's fault counts since the last step, and whether its protection covers them."""
    counts = store.fault_counts()
    for name in ("corrected_words", "erased_words", "corrupted_blocks"):
        setattr(cert, name, counts[name])
    cert.faults_covered = store.protection.covers_faults
