"""What a report says about the machine it was made on (:mod:`certkv.provenance`)."""

from __future__ import annotations

import os
import platform

import llvmlite.binding as llvm
import torch

from certkv import provenance


def test_a_cpu_is_named_by_its_model_the_target_numba_compiles_for_and_its_cores(monkeypatch):
    """Two machines of one architecture can differ twofold in speed and in their kernels' last
    bits (a Zen 5 and a Xeon here): the device line names the CPU's model and llvmlite's name
    for it, not only ``x86_64``."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    name = provenance.device_name()
    model = provenance.cpu_model()
    assert model and model in name
    assert provenance.compiled_for() == llvm.get_host_cpu_name()
    assert name == (f"CPU ({model}, {llvm.get_host_cpu_name()}, {platform.machine()}, "
                    f"{os.cpu_count()} cores)")


def test_without_llvmlite_the_cpu_line_leaves_the_target_out(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(provenance, "compiled_for", lambda: "")
    assert ", ," not in provenance.device_name()
    assert provenance.device_name().endswith(f"{platform.machine()}, {os.cpu_count()} cores)")
