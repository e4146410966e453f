"""A decode step reads from the device at most twice (the page-in plan, the fallback flags) and
never stalls on the device anywhere else. Checked on CPU by an auditor that treats every tensor
as device-resident unless it came from ``to_host`` (or is host bookkeeping derived from it) and
records every operation that would wait for the device on CUDA."""

from __future__ import annotations

import traceback

import pytest
import torch
from helpers import make_kv, make_query
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import certkv.attention as attention_module
from certkv import CertifiedAttention, TieredKVStore
from certkv.cache.scratch import ScratchCache
from certkv.certify.values import LocalThreshold

T = torch.Tensor
READS = {T.__bool__, T.__int__, T.__float__, T.__index__, T.item, T.tolist, T.nonzero,
         torch.nonzero, T.cpu, T.numpy, T.unique, torch.unique, T.masked_select,
         torch.masked_select, T.argwhere, torch.argwhere, torch.equal, torch.allclose}
INDEXING = {T.__getitem__, T.__setitem__}
FACTORIES = {torch.zeros, torch.ones, torch.full, torch.empty, torch.arange, torch.tensor,
             torch.rand, torch.randn, torch.randint, torch.as_tensor}


def caller() -> str:
    """``file:line`` of the innermost certkv (or test) frame."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "certkv/" in frame.filename or "tests/" in frame.filename:
            return f"{frame.filename.split('/')[-1]}:{frame.lineno}"
    return "?"


class HostReadAudit(TorchFunctionMode):
    """Records operations on device tensors that need their values on the host."""

    def __init__(self) -> None:
        super().__init__()
        self.host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive: ids stay unique)
        self.stalls: list[str] = []

    def mark_host(self, out) -> None:
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.host[id(t)] = t

    def is_host(self, t: torch.Tensor) -> bool:
        return id(t) in self.host

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [t for t in tensors if not self.is_host(t)]
        name = getattr(func, "__name__", str(func))
        if func in READS and on_device:
            self.stalls.append(f"{name} at {caller()}")
        index = [t for t in tree_leaves(args[1:2]) if isinstance(t, torch.Tensor)]
        if func in INDEXING and any(t.dtype == torch.bool and not self.is_host(t)
                                    for t in index):
            self.stalls.append(f"{name}[bool mask] at {caller()}")
        moved = func is T.to and any(isinstance(a, (str, torch.device)) for a in args[1:])
        if func in FACTORIES:
            if kwargs.get("device") is None:  # code meant for CUDA names its device
                self.mark_host(out)
        elif (tensors and not on_device and not moved) or func is T.cpu:
            self.mark_host(out)
        return out


@pytest.fixture
def audit(monkeypatch):
    auditor = HostReadAudit()
    reads = []
    original = attention_module.to_host

    def counted(x):
        reads.append(tuple(x.shape))
        with torch.overrides._pop_mode_temporarily():
            out = original(x)
        auditor.mark_host(out)
        return out

    monkeypatch.setattr(attention_module, "to_host", counted)
    return auditor, reads


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
