"""A seeded bit-flip injector: the binary symmetric channel of seed 003 over stored bytes.

Every bit of the given bytes flips independently with probability ``p``. Faults are applied once
to storage (persistent memory faults, the seed's model) by the caller; flipping on every read
(transient faults) is the caller calling it again on a copy. The flips depend only on the
generator's seed and the tensor's shape, so a faulty run reproduces.
"""

from __future__ import annotations

import torch

from certkv.errors import ConfigError, require
from certkv.quant.packing import pack_bits


def check_rate(p: float) -> float:
    """Validate a flip probability; returns it."""
    require(isinstance(p, (int, float)) and 0 <= p <= 1, ConfigError,
            f"fault rate p={p!r} must be a probability in [0, 1], e.g. 1e-3.")
    return float(p)


def flip_mask(shape: tuple[int, ...], p: float, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, int]:
    """uint8 ``shape`` with each of its ``8 numel`` bits set with probability ``p``, and how
    many are set."""
    check_rate(p)
    if p == 0:
        return torch.zeros(shape, dtype=torch.uint8, device=device), 0
    bits = torch.rand(*shape, 8, generator=generator) < p
    return pack_bits(bits.to(torch.uint8), 1).reshape(shape).to(device), int(bits.sum())


def inject(data: torch.Tensor, p: float, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """``data`` (any integer dtype, its bytes) with its bits flipped at rate ``p``, and the
    number of bits flipped."""
    raw = data.contiguous().view(torch.uint8)
    mask, flipped = flip_mask(tuple(raw.shape), p, generator, raw.device)
    return (raw ^ mask).view(data.dtype).reshape(data.shape), flipped
