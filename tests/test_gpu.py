"""CUDA: the same store and contract on the GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
from helpers import cuda_layer, make_kv, reference_fp64

from certkv import CertifiedAttention, TieredKVStore

pytestmark = pytest.mark.gpu


def test_tier2_is_pinned_host_memory_and_tier1_on_device():
    k, v = make_kv(2, 64, 32, seed=0)
    store = TieredKVStore(2, 32, device="cuda")
    store.append(k.cuda(), v.cuda())
    assert store.key_blocks()["codes"].is_cuda
    assert store._tier2.view()["k"].is_pinned()


@pytest.mark.parametrize("context", [1000, 16384])
def test_contract_on_cuda(context):
    store, q = cuda_layer(4, context, 128, group=4)
    out, cert = CertifiedAttention()(q, store)
    err = (out.double() - reference_fp64(q, store)).norm(dim=-1)
    fast = cert.rung < 3
    assert (err[fast] <= cert.bound.double()[fast] * (1 + 1e-5) + 1e-4).all()
