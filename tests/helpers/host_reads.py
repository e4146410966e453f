"""Which operations of a step read device tensors on the host (test_host_reads.py,
test_device_fallback.py; the ``audit`` fixture in conftest)."""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

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
