"""Where the pieces of a step run (:mod:`certkv.dispatch`): the step asks these methods, never a
component's type or the device itself."""

from __future__ import annotations

import pytest
import torch

from certkv.attention import CertifiedAttention
from certkv.certify.fused_cpu import AVAILABLE
from certkv.certify.select import AdaptiveTopK
from certkv.kernels.compiled import CompiledSegment

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object needs no GPU
needs_numba = pytest.mark.skipif(not AVAILABLE, reason="numba is not installed")


@needs_numba
def test_the_default_cpu_step_runs_selection_and_certificate_as_fused_loops():
    attention = CertifiedAttention()
    assert attention._fused_cpu(CPU, on_device=False)
    assert attention._fused_select(CPU, None, None)
    assert attention._compiler(CPU) is None  # segments eager on a CPU by default


@needs_numba
def test_what_the_fused_loops_do_not_cover_runs_the_segments():
    """A selector the fused selection does not compute, a naive step, a drawn exploration, a
    boosted step or a device fallback leave the selection (and, on the device path, the
    certificate) to the PyTorch segments."""
    union = CertifiedAttention(AdaptiveTopK(kv_group_union=True))
    assert not union._fused_select(CPU, None, None) and union._fused_cpu(CPU, False)
    assert not CertifiedAttention(mode="naive")._fused_select(CPU, None, None)
    default = CertifiedAttention()
    assert not default._fused_select(CPU, torch.zeros(1), None)  # an exploration draw
    assert not default._fused_select(CPU, None, torch.zeros(1))  # a bound tolerance's boost
    assert not default._fused_cpu(CPU, on_device=True)
    assert not default._fused_cpu(CUDA, on_device=False)


def test_compile_picks_the_segments_compiler_per_device():
    """By default inductor on CUDA and eager elsewhere; ``compile=True`` is inductor anywhere,
    a string names the backend, ``False`` is eager everywhere; a compiled segment is made once
    per (segment, backend) and a CPU step asked to compile runs no fused loops."""
    assert CertifiedAttention()._compiler(CUDA) == "inductor"
    assert CertifiedAttention(compile=False)._compiler(CUDA) is None
    assert CertifiedAttention(compile="aot_eager")._compiler(CPU) == "aot_eager"
    compiled = CertifiedAttention(compile=True)
    assert compiled._compiler(CPU) == "inductor" and not compiled._fused_cpu(CPU, False)
    segment = compiled._segment("_certify_step", CPU)
    assert isinstance(segment, CompiledSegment)
    assert compiled._segment("_certify_step", CPU) is segment
    eager = CertifiedAttention(compile=False)
    assert eager._segment("_select_step", CPU) == eager._select_step


def test_each_query_head_maps_to_its_kv_head_once_per_shape():
    attention = CertifiedAttention()
    kv_of = attention._kv_of(12, 4, CPU)
    assert kv_of.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert attention._kv_of(12, 4, CPU) is kv_of
