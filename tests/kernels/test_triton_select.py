"""The selection in one Triton launch (issue 55, :mod:`certkv.kernels.triton_select`) against
the PyTorch operators it replaces on the device path: the same log-masses, ``Delta_b`` and
norms up to FP32 rounding, the same key sets, rung-1 expansions and value promotions except
where a threshold falls within that rounding (the kernel's sums are FP64, as the CPU's fused
loop nest's), over the contract test's scenarios. Under TRITON_INTERPRET=1 on CPU; the device
steps that use it are held to FP64 attention by the contract tests."""

from __future__ import annotations

import torch
from helpers import examples, make_kv, make_query
from helpers.contract import scenarios
from helpers.select import check_selections
from hypothesis import HealthCheck, given, settings

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.kernels.triton_select import select
from certkv.opcount import StepCounter


@settings(max_examples=examples(40), suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(scenarios())
def test_the_kernel_selects_as_the_operators_do(sc):
    check_selections(sc, select)


def test_a_device_step_selects_in_the_kernel_as_the_segment_would():
    """The default policy on the device path selects in the kernel (no selection segment;
    ``tests/test_opcount.py`` counts the step's launches): the same rungs and key counts as
    the selection segment on the same step."""
    k, v = make_kv(2, 300, 64, seed=0, outlier_channels=2)
    store = TieredKVStore(2, 64)
    store.append(k, v)
    q = make_query(k, 2, seed=0, peaked=True)
    attn, scratch = CertifiedAttention(backend="triton", compile=False), ScratchCache(4, 4)
    attn(q, store, scratch=scratch)
    counter = StepCounter()
    with counter.watching(attn):
        attn(q, store, scratch=scratch)
    assert not counter.segments and counter.kernels["_select_kernel"] == 1
    plain = CertifiedAttention(backend="triton", compile=False)
    plain.backend.select = lambda *args: None  # the selection segment
    (out, cert), (out_s, cert_s) = attn(q, store), plain(q, store)
    assert torch.equal(cert.k_star, cert_s.k_star) and torch.equal(cert.rung, cert_s.rung)
    torch.testing.assert_close(out, out_s, rtol=1e-5, atol=1e-6)
