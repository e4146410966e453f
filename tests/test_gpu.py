"""CUDA: the same store and contract on the GPU (skipped without CUDA)."""

from __future__ import annotations

import pytest
from helpers import make_kv, make_query, reference_fp64

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
    k, v = make_kv(4, context, 128, seed=1, outlier_channels=4)
    store = TieredKVStore(4, 128, device="cuda")
    store.append(k.cuda(), v.cuda())
    q = make_query(k, 4, seed=2, scale=2.0, peaked=True).cuda()
    out, cert = CertifiedAttention()(q, store)
    err = (out.double() - reference_fp64(q, store)).norm(dim=-1)
    fast = cert.rung < 3
    assert (err[fast] <= cert.bound.double()[fast] * (1 + 1e-5) + 1e-4).all()
