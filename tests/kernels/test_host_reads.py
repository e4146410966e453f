"""A decode step reads from the device at most twice (the page-in plan, the fallback flags) and
never stalls on the device anywhere else. Checked on CPU by an auditor that treats every tensor
as device-resident unless it came from ``to_host`` (or is host bookkeeping derived from it) and
records every operation that would wait for the device on CUDA."""

from __future__ import annotations

import pytest
import torch
from helpers import make_kv, make_query

from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.values import LocalThreshold


def layer(seed=0):
    k, v = make_kv(2, 300, 32, seed=seed, outlier_channels=2)
    store = TieredKVStore(2, 32, value_group=8)
    store.append(k, v)
    return store, make_query(k, 3, seed=seed, scale=4.0, peaked=True)


@pytest.mark.parametrize("mode", ["certified", "naive"])
def test_a_step_reads_from_the_device_only_through_to_host(audit, mode):
    auditor, reads = audit
    store, q = layer()
    # compile=False and backend=torch: the segments and phases as the PyTorch code that runs on
    # CUDA (on CPU tensors the defaults fuse them into numba loops that read them as NumPy
    # arrays, never on a GPU)
    attn = CertifiedAttention(mode=mode, value_policy=LocalThreshold(v_tol=1e-4), compile=False,
                              backend="torch")
    scratch = ScratchCache(key_blocks=8, value_blocks=8)
    for _ in range(2):  # the second step hits the scratch cache
        reads.clear()
        with auditor:
            _out, cert = attn(q, store, scratch=scratch)
        assert auditor.stalls == []
        assert len(reads) == (2 if mode == "certified" else 1)
    if mode == "certified":
        assert cert.k_star.sum() > 0 and cert.value_promotions > 0  # page-in really ran
        assert scratch.stats.hits > 0


def test_the_audit_catches_a_hidden_sync(audit):
    auditor, _ = audit
    x = torch.ones(3)
    with auditor:
        bool(x.any())
        x[x > 0] = 2.0
    assert [s.split(" at ")[0] for s in auditor.stalls] == ["__bool__", "__setitem__[bool mask]"]
