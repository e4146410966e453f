"""Pack sub-byte unsigned codes along the last dimension (little-endian bit order).

2-, 4- and 8-bit codes pack ``8 // bits`` to a byte: code ``i`` of a byte occupies its bits
``[i * bits, (i + 1) * bits)``. 3-bit codes pack in runs of 8 codes into 3 bytes: the run is the
little-endian 24-bit word ``w = byte0 | byte1 << 8 | byte2 << 16`` and code ``i`` of the run
occupies bits ``[3 i, 3 i + 3)`` of ``w`` (so codes 2 and 5 straddle a byte boundary).
"""

from __future__ import annotations

import torch

from certkv.errors import ConfigError, require

SUPPORTED_BITS = (2, 3, 4, 8)

_RUN3 = 8  # 3-bit codes per run (one run = 3 bytes)


def check_bits(bits: int, allowed: tuple[int, ...] = SUPPORTED_BITS) -> int:
    """Validate a code width; returns it unchanged."""
    require(bits in allowed, ConfigError, f"bits={bits} is not supported; use one of {allowed}.")
    return bits


def check_packable(head_dim: int, bits: int, kind: str) -> None:
    """Sub-byte codes are packed ``8 // bits`` per byte along ``head_dim`` (3-bit codes 8 per 3
    bytes): it must divide."""
    if bits == 3:
        require(head_dim % _RUN3 == 0, ConfigError,
                f"head_dim={head_dim} cannot hold 3-bit {kind} codes (8 codes per 3 bytes); use "
                f"a head_dim that is a multiple of 8, e.g. {_RUN3 * -(-head_dim // _RUN3)}.")
        return
    per_byte = 8 // bits
    require(head_dim % per_byte == 0, ConfigError,
            f"head_dim={head_dim} cannot hold {bits}-bit {kind} codes ({per_byte} per byte); use "
            f"a head_dim that is a multiple of {per_byte}, e.g. "
            f"{per_byte * -(-head_dim // per_byte)}.")


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned codes ``[..., n]`` (values < 2**bits) into bytes ``[..., n * bits // 8]``.

    Code ``i`` of a byte occupies bits ``[i * bits, (i + 1) * bits)``; 8-bit codes pass through;
    3-bit codes go 8 to a little-endian 24-bit word of 3 bytes (module docstring).
    """
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if bits == 3:
        return _pack3(codes)
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
    if bits == 3:
        return _unpack3(packed)
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def _pack3(codes: torch.Tensor) -> torch.Tensor:
    n = codes.shape[-1]
    require(n % _RUN3 == 0, ConfigError,
            f"a last dimension of {n} cannot be packed at 3 bits; make it a multiple of 8.")
    runs = codes.reshape(*codes.shape[:-1], n // _RUN3, _RUN3).to(torch.int32)
    shifts = torch.arange(0, 3 * _RUN3, 3, dtype=torch.int32, device=codes.device)
    word = (runs << shifts).sum(dim=-1)  # [..., n / 8], 24 bits used
    byte_shifts = torch.arange(0, 24, 8, dtype=torch.int32, device=codes.device)
    packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(*codes.shape[:-1], n // _RUN3 * 3)


def _unpack3(packed: torch.Tensor) -> torch.Tensor:
    m = packed.shape[-1]
    require(m % 3 == 0, ConfigError,
            f"{m} bytes cannot hold 3-bit codes (8 codes per 3 bytes); make it a multiple of 3.")
    runs = packed.reshape(*packed.shape[:-1], m // 3, 3).to(torch.int32)
    byte_shifts = torch.arange(0, 24, 8, dtype=torch.int32, device=packed.device)
    word = (runs << byte_shifts).sum(dim=-1)
    shifts = torch.arange(0, 3 * _RUN3, 3, dtype=torch.int32, device=packed.device)
    codes = (word.unsqueeze(-1) >> shifts) & 0b111
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], m // 3 * _RUN3)


def pack_flags(flags: torch.Tensor) -> torch.Tensor:
    """Booleans ``[..., m]`` -> bytes ``[..., ceil(m / 8)]``, flag ``i`` of a byte in bit ``i``
    (zero-padded to a whole byte)."""
    m = flags.shape[-1]
    pad = -m % 8
    bits = torch.nn.functional.pad(flags.to(torch.uint8), (0, pad))
    return pack_bits(bits, 1)


def unpack_flags(packed: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_flags`: bytes ``[..., ceil(m / 8)]`` -> booleans ``[..., m]``."""
    return unpack_bits(packed, 1)[..., :m].bool()
