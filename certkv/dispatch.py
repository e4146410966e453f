"""Where the pieces of a quantized step run (:class:`Dispatch`, a base of
:class:`~certkv.step.QuantizedStep`, which asks it rather than testing types or devices itself).

* The pure tensor segments, selection (:func:`~certkv.certify.step_select.select_step`) and the
  certificate (:func:`~certkv.certify.step_certify.certify_step`), as methods so that a segment
  compiled by ``torch.compile`` guards on the components the attention holds: eager, or
  compiled where ``compile`` asks for it on the step's device (:meth:`Dispatch._segment`; by
  default inductor on CUDA, eager elsewhere).
* The fused CPU loop nests (numba) where they cover the step: the certificate
  (:meth:`Dispatch._fused_cpu`) and the selection (:meth:`Dispatch._fused_select`).
* Per-shape constants (:meth:`Dispatch._kv_of`).

The attention's fields it reads: ``compile``, ``mode``, ``selector``, ``ladder``,
``value_policy``, and its caches ``_compiled`` and ``_constants``.
"""

from __future__ import annotations

import torch

from certkv.certify import fused_cpu, fused_select
from certkv.certify.segment import CertifyInputs, CertifyOutputs, SelectInputs, Selection
from certkv.certify.step_certify import certify_fused, certify_step
from certkv.certify.step_select import select_step
from certkv.kernels.compiled import CompiledSegment


class Dispatch:
    """Which implementation runs each piece of a step (see the module)."""

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

    # the pure tensor segments (certkv.certify.step_select / step_certify), as methods so that
    # a compiled segment guards on the components this attention holds
    def _select_step(self, x: SelectInputs) -> Selection:
        """:func:`certkv.certify.step_select.select_step` with this attention's components."""
        return select_step(self, x)

    def _certify_step(self, x: CertifyInputs, spec, coef) -> CertifyOutputs:
        """:func:`certkv.certify.step_certify.certify_step` with this attention's components."""
        return certify_step(self, x, spec, coef)

    def _certify_fused(self, x: CertifyInputs, spec, coef) -> CertifyOutputs:
        """:func:`certkv.certify.step_certify.certify_fused` with this attention's components
        (host fallback only: the device fallback's final ``e_arith`` is the PyTorch
        segment's, :meth:`_fused_cpu`)."""
        return certify_fused(self, x, spec, coef)
