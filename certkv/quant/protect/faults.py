"""A seeded bit-flip injector: the binary symmetric channel of seed 003 over stored bytes.

Every bit of the given bytes flips independently with probability ``p``. Faults are applied once
to storage (persistent memory faults, the seed's model) by the caller; flipping on every read
(transient faults) is the caller calling it again on a copy. The flips depend only on the
generator's seed and the tensor's shape, so a faulty run reproduces.
"""

from __future__ import annotations

import math

import torch

from certkv.errors import ConfigError, require


def check_rate(p: float) -> float:
    """Validate a flip probability; returns it."""
    require(isinstance(p, (int, float)) and 0 <= p <= 1, ConfigError,
            f"fault rate p={p!r} must be a probability in [0, 1], e.g. 1e-3.")
    return float(p)


def flip_positions(n_bits: int, p: float, generator: torch.Generator) -> torch.Tensor:
    """Ascending int64 positions of the bits that flip among ``n_bits``, each independently
    with probability ``p``: the gaps between flips of a Bernoulli process are geometric, drawn
    by inversion (``floor(log U / log(1 - p))``), so the cost follows the flips, not the bits."""
    if p == 0 or n_bits == 0:
        return torch.zeros(0, dtype=torch.int64)
    if p == 1:
        return torch.arange(n_bits)
    log_q = math.log1p(-p)
    found, last = [], -1
    while last < n_bits:
        batch = int(n_bits * p + 10 * math.sqrt(n_bits * p) + 16)
        u = 1.0 - torch.rand(batch, generator=generator, dtype=torch.float64)  # (0, 1]
        gaps = torch.floor(torch.log(u) / log_q).to(torch.int64)
        positions = last + torch.cumsum(gaps + 1, dim=0)
        found.append(positions[positions < n_bits])
        last = int(positions[-1])
    return torch.cat(found)


def flip_mask(shape: tuple[int, ...], p: float, generator: torch.Generator,
              device: str | torch.device = "cpu") -> tuple[torch.Tensor, int]:
    """uint8 ``shape`` with each of its ``8 numel`` bits set with probability ``p``, and how
    many are set (bit ``b`` of byte ``i`` is stream bit ``8 i + b``)."""
    check_rate(p)
    numel = math.prod(shape)
    positions = flip_positions(8 * numel, p, generator)
    mask = torch.zeros(numel, dtype=torch.int64)
    mask.index_add_(0, positions // 8, 1 << (positions % 8))
    return mask.to(torch.uint8).reshape(shape).to(device), int(positions.numel())


def inject(data: torch.Tensor, p: float, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """``data`` (any integer dtype, its bytes) with its bits flipped at rate ``p``, and the
    number of bits flipped."""
    if not data.numel():  # no bytes (no block): nothing flips
        return data, 0
    raw = data.contiguous().view(torch.uint8)
    mask, flipped = flip_mask(tuple(raw.shape), p, generator, raw.device)
    return (raw ^ mask).view(data.dtype).reshape(data.shape), flipped
