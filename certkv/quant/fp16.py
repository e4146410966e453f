"""FP16 passthrough codec: keeps the originals in Tier-1 (bound 0).

Used for ablations such as "INT8 keys + FP16 values" (paper 9.4.1) and as the dense reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from certkv.quant.base import Blocks, KeyCodec, ValueCodec
from certkv.quant.layout import CodeLayout, keeps
from certkv.registry import KEY_CODECS, VALUE_CODECS


@KEY_CODECS.register("fp16")
@dataclass
class FP16KeyCodec(KeyCodec):
    """Keys stored as FP16; Delta_b = 0."""

    bits: int = 16
    name: str = "fp16"
    stores_codes = False
    exact = True

    def kernel_layout(self) -> CodeLayout | None:
        return CodeLayout(fp16=True) if keeps(self, FP16KeyCodec) else None

    def encode(self, k: torch.Tensor) -> Blocks:
        return {"data": k.to(torch.float16)}

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return blocks["data"].float()

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        data = blocks["data"]
        return torch.zeros(*data.shape[:2], data.shape[-1], device=data.device)


@VALUE_CODECS.register("fp16")
@dataclass
class FP16ValueCodec(ValueCodec):
    """Values stored as FP16; eta_b = 0."""

    bits: int = 16
    name: str = "fp16"
    stores_codes = False
    exact = True

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        return CodeLayout(fp16=True) if keeps(self, FP16ValueCodec) else None

    def encode(self, v: torch.Tensor) -> Blocks:
        return {"data": v.to(torch.float16)}

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return blocks["data"].float()

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        data = blocks["data"]
        return torch.zeros(data.shape[:3], device=data.device)
