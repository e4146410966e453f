"""Pack sub-byte unsigned codes along the last dimension (little-endian within a byte)."""

from __future__ import annotations

import torch

from certkv.errors import ConfigError, require

SUPPORTED_BITS = (2, 4, 8)


def check_bits(bits: int, allowed: tuple[int, ...] = SUPPORTED_BITS) -> int:
    """Validate a code width; returns it unchanged."""
    require(bits in allowed, ConfigError, f"bits={bits} is not supported; use one of {allowed}.")
    return bits


def check_packable(head_dim: int, bits: int, kind: str) -> None:
    """Sub-byte codes are packed ``8 // bits`` per byte along ``head_dim``: it must divide."""
    per_byte = 8 // bits
    require(head_dim % per_byte == 0, ConfigError,
            f"head_dim={head_dim} cannot hold {bits}-bit {kind} codes ({per_byte} per byte); use "
            f"a head_dim that is a multiple of {per_byte}, e.g. "
            f"{per_byte * -(-head_dim // per_byte)}.")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``[..., n]`` (values < 2**bits) into bytes ``[..., n * bits // 8]``.

    Code ``i`` of a byte occupies bits ``[i * bits, (i + 1) * bits)``; 8-bit codes pass through.
    """
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    per_byte = 8 // bits
    n = codes.shape[-1]
    require(n % per_byte == 0, ConfigError,
            f"a last dimension of {n} cannot be packed at {bits} bits; make it a multiple of "
            f"{per_byte}.")
    grouped = codes.reshape(*codes.shape[:-1], n // per_byte, per_byte)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: bytes ``[..., m]`` -> codes ``[..., m * 8 // bits]``."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))
