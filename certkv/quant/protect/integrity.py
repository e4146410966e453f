"""A per-block integrity check: a universal hash of a block's codes and metadata.

Each block (per kv head) stores two 31-bit hashes ``h_j = sum_i x_i w_ji mod P`` of its bytes
``x`` (codes and every metadata tensor), with ``P = 2^31 - 1`` and fixed pseudo-random weights
``w_ji`` in ``[1, P)``. Written when the block is quantized, recomputed from what is read: a
mismatch marks the block as corrupted. For any change ``e != 0`` of the bytes, ``sum_i e_i w_i``
is a nonzero polynomial of degree 1 in each weight, so over the draw of the weights a change
passes both hashes with probability at most ``P^-2 < 2^-61`` (faults drawn independently of the
weights). That is the only residual risk of the certificate under storage faults, and it is
stated in the certificate's docs (:mod:`certkv.quant.protect.codec`). 8 bytes per block per
kv head, counted in Tier-1.
"""

from __future__ import annotations

import math

import torch

from certkv.quant.base import Blocks

PRIME = (1 << 31) - 1
_WEIGHT_SEED = 0x5EEDC4EC


def block_bytes(blocks: Blocks, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """Every tensor of ``blocks`` (leading dims ``[Hkv, n]``, names in ``skip`` left out), as
    bytes ``[Hkv, n, L]`` (uint8), in name order."""
    parts = []
    for name in sorted(blocks):
        if name in skip:
            continue
        t = blocks[name]
        flat = t.contiguous().reshape(t.shape[0], t.shape[1], math.prod(t.shape[2:]))
        parts.append(flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8))
    return torch.cat(parts, dim=-1)


def _weights(length: int, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(_WEIGHT_SEED + length)
    return torch.randint(1, PRIME, (2, length), generator=gen, dtype=torch.int64).to(device)


def block_hash(blocks: Blocks, skip: tuple[str, ...] = ()) -> torch.Tensor:
    """int32 ``[Hkv, n, 2]``: the two hashes of each block's bytes (:func:`block_bytes`).
    Products stay below ``2^39`` and sums below ``2^63`` for blocks under 16 MiB."""
    x = block_bytes(blocks, skip).to(torch.int64)  # [Hkv, n, L]
    w = _weights(x.shape[-1], x.device)  # [2, L]
    return ((x.unsqueeze(-2) * w).sum(dim=-1) % PRIME).to(torch.int32)
