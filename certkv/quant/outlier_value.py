"""Dense-and-sparse value codec with uniform or normal-float levels (KVQuant 3.3-3.4).

Per block and kv head the ``m = ceil(outlier_fraction * B * d)`` entries of largest magnitude
are kept exactly in a fixed-size sparse list: ``"sparse_idx"`` (int16 flat index ``t d + c``)
and ``"sparse_val"`` (their FP16 values), ``[Hkv, n, m]`` each (fixed size, so the block keeps
the ``[Hkv, n]`` leading layout). Every other entry is quantized densely per token in groups of
``group`` channels, with ranges taken over the group's dense entries only (the outliers no longer
stretch them):

* ``levels="nonuniform"``: a fixed normal-float codebook of ``2^bits`` levels in ``[-1, 1]``
  (QLoRA's NF construction: normal quantiles, one exact zero, both ends at -1 and 1), scaled per
  token group by its absmax ``S`` (FP16, exact: it is one of the originals' magnitudes); codes
  pick the nearest level; metadata ``"scale"``;
* ``levels="uniform"``: asymmetric ``min / scale`` as :class:`GroupAffineValueCodec` (FP16 scale
  ``s = (max - min) / (2^bits - 1)`` rounded up, FP16 offset ``o = min``); metadata ``"scale"``,
  ``"offset"``.

Codes are ``bits``-wide, packed along the channels (:mod:`certkv.quant.packing`). Storage per
block and kv head: ``B d bits / 8`` (codes) + ``2 B d / g`` (scales) + ``2 B d / g`` (offsets,
uniform only) + ``4 m`` (sparse list) bytes; at d=64, B=32, g=32, 3 bits, 1 %: m = 21, so
30.625 bytes per token non-uniform and 34.625 uniform (FP16: 128).

**Bound** per dense entry (``u = 2^-24``): non-uniform ``(h + 8u) S`` with ``h`` half the largest
gap between adjacent (stored FP32) levels: ``|x / S| <= 1`` so ``y = fl(x / S)`` is within ``u``
of ``x / S``, the nearest level by FP32 midpoints is within ``h + u`` of ``y``, and ``fl(L S)``
adds ``u S``. Uniform ``s / 2 + 8u (2^bits s + |o|)`` (the difference, the division and the
clamp move the code by at most ``3 u 2^bits``, the decode ``q s + o`` rounds twice). Sparse
entries are exact. ``token_bound`` is the l2 over the token's dense entries (FP64, rounded up).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import FP32_EPS, Blocks, ValueCodec, round_up_fp16
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import VALUE_CODECS

LEVELS = ("nonuniform", "uniform")
_INDEX_LIMIT = 2**15  # int16 flat indices: B * d <= 32768


@cache
def normal_float_levels(bits: int) -> tuple[float, ...]:
    """``2^bits`` ascending levels in ``[-1, 1]`` (FP32 values): normal quantiles as in QLoRA's
    NF4 (``2^(bits-1)`` positive, ``2^(bits-1) - 1`` negative, an exact 0), normalised so both
    ends are -1 and 1; ``normal_float_levels(4)`` is NF4."""
    n = 1 << bits
    offset = ((1 - 1 / (2 * (n - 1))) + (1 - 1 / (2 * n))) / 2
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, n // 2 + 1, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, n // 2, dtype=torch.float64)[:-1])
    values = torch.cat([pos, torch.zeros(1, dtype=torch.float64), neg])
    values = (values / values.abs().max()).sort().values.float()
    values[0], values[-1] = -1.0, 1.0
    return tuple(values.tolist())


@cache
def _level_table(bits: int, device: str) -> torch.Tensor:
    """FP32 ``[2^bits]`` normal-float levels on ``device``, made once per setting (the codec's
    decode and the kernels index the same table; nothing writes it)."""
    return torch.tensor(normal_float_levels(bits), dtype=torch.float32, device=device)


def _up32(x: torch.Tensor) -> torch.Tensor:
    """Non-negative FP64 -> FP32, never below ``x``."""
    return (x * (1 + 2.0**-21) + 2.0**-149).float()


@VALUE_CODECS.register("outlier")
@dataclass
class OutlierValueCodec(ValueCodec):
    """Values: exact sparse outliers + ``bits``-wide dense codes per ``group`` channels per
    token, with ``levels`` ``"nonuniform"`` (normal-float, absmax) or ``"uniform"`` (min/scale)."""

    bits: int = 3
    group: int = 32
    levels: str = "nonuniform"
    outlier_fraction: float = 0.01
    name: str = "outlier_value"

    def __post_init__(self) -> None:
        check_bits(self.bits)
        require(isinstance(self.group, int) and self.group >= 1, ConfigError,
                f"value_group={self.group!r} must be a positive integer such as 32.")
        require(self.levels in LEVELS, ConfigError,
                f"levels={self.levels!r} is unknown; use one of {list(LEVELS)}.")
        require(isinstance(self.outlier_fraction, (int, float))
                and 0 <= self.outlier_fraction < 1, ConfigError,
                f"outlier_fraction={self.outlier_fraction!r} must lie in [0, 1), e.g. 0.01.")

    # ------------------------------------------------------------------ layout
    def num_outliers(self, block_size: int, head_dim: int) -> int:
        """``m = ceil(outlier_fraction * B * d)`` (a product within 1e-9 of an integer counts
        as that integer)."""
        return math.ceil(self.outlier_fraction * block_size * head_dim - 1e-9)

    def bytes_per_block(self, block_size: int, head_dim: int) -> int:
        """Tier-1 bytes of one block and kv head (module docstring)."""
        groups = block_size * head_dim // self.group
        meta = (2 if self.levels == "uniform" else 1) * 2 * groups
        return (block_size * head_dim * self.bits // 8 + meta
                + 4 * self.num_outliers(block_size, head_dim))

    def validate(self, head_dim: int, block_size: int) -> None:
        check_packable(head_dim, self.bits, "value")
        divisor = max(c for c in range(1, min(head_dim, 32) + 1) if head_dim % c == 0)
        require(head_dim % self.group == 0, ConfigError,
                f"value_group={self.group} does not divide head_dim={head_dim}; use a divisor "
                f"of {head_dim}, e.g. value_group={divisor}.")
        require(block_size * head_dim <= _INDEX_LIMIT, ConfigError,
                f"block_size * head_dim = {block_size * head_dim} exceeds the int16 outlier "
                f"index range ({_INDEX_LIMIT}); use block_size <= {_INDEX_LIMIT // head_dim}.")

    def _codebook(self, device: torch.device) -> torch.Tensor:
        return _level_table(self.bits, str(device))

    def _half_gap(self) -> float:
        levels = torch.tensor(normal_float_levels(self.bits), dtype=torch.float64)
        return float(levels.diff().max()) / 2

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group)

    # ------------------------------------------------------------------ codec interface
    def encode(self, v: torch.Tensor) -> Blocks:
        hkv, n, block, d = v.shape
        require(block * d <= _INDEX_LIMIT, ConfigError,
                f"block_size * head_dim = {block * d} exceeds the int16 outlier index range "
                f"({_INDEX_LIMIT}); use block_size <= {_INDEX_LIMIT // d}.")
        x = v.float()
        flat = x.reshape(hkv, n, block * d)
        m = self.num_outliers(block, d)
        idx = flat.abs().topk(m, dim=-1).indices if m else flat.new_zeros(hkv, n, 0).long()
        sparse = torch.zeros_like(flat, dtype=torch.bool).scatter_(-1, idx, True)
        sparse = self._grouped(sparse.reshape(x.shape))  # [Hkv, n, B, d/g, g]
        grouped = self._grouped(x)
        inf = torch.full_like(grouped, float("inf"))
        blocks: Blocks = {}
        if self.levels == "uniform":
            lo = torch.where(sparse, inf, grouped).amin(dim=-1, keepdim=True)
            hi = torch.where(sparse, -inf, grouped).amax(dim=-1, keepdim=True)
            empty = torch.isinf(lo)  # every entry of the group is an outlier
            lo, hi = lo.masked_fill(empty, 0.0), hi.masked_fill(empty, 0.0)
            scale = round_up_fp16((hi - lo) / ((1 << self.bits) - 1))
            offset = lo.to(torch.float16)  # exact: the originals are FP16
            safe = torch.where(scale > 0, scale.float(), torch.ones_like(lo))
            codes = torch.round((grouped - offset.float()) / safe)
            codes = codes.clamp(0, (1 << self.bits) - 1)
            blocks.update(scale=scale.squeeze(-1), offset=offset.squeeze(-1))
        else:
            absmax = torch.where(sparse, torch.zeros_like(grouped), grouped.abs())
            scale = absmax.amax(dim=-1, keepdim=True).to(torch.float16)  # exact: an original
            safe = torch.where(scale > 0, scale.float(), torch.ones_like(grouped[..., :1]))
            y = (grouped / safe).clamp(-1.0, 1.0)  # outliers clamp; decode overwrites them
            levels = self._codebook(v.device).double()
            mids = ((levels[1:] + levels[:-1]) / 2).float()
            codes = torch.bucketize(y, mids)
            blocks["scale"] = scale.squeeze(-1)
        codes = codes.masked_fill(sparse, 0).reshape(x.shape).to(torch.uint8)
        blocks["codes"] = pack_bits(codes, self.bits)
        blocks["sparse_idx"] = idx.to(torch.int16)
        blocks["sparse_val"] = flat.gather(-1, idx).to(torch.float16)  # exact: FP16 originals
        return blocks

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        """``bits``-wide codes (2, 3, 4 or 8) per token in groups of ``group`` channels, decoded
        by the normal-float ``codebook`` (``L[code] S``) or affinely (``levels="uniform"``),
        then the block's exact outliers in place (:class:`~certkv.quant.layout.CodeLayout`)."""
        if not keeps(self, OutlierValueCodec) or self.bits not in KERNEL_BITS \
                or head_dim % self.group:
            return None
        return CodeLayout(False, self.bits, group=self.group,
                          codebook=self.levels == "nonuniform", outliers=True)

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored tensors (views) and, for normal-float codes, the FP32 levels
        (``levels [2^bits]``, the codebook :meth:`decode` indexes)."""
        if self.levels == "uniform":
            return blocks
        return {**blocks, "levels": self._codebook(blocks["codes"].device)}

    def decode(self, blocks: Blocks) -> torch.Tensor:
        codes = unpack_bits(blocks["codes"], self.bits)
        grouped = self._grouped(codes)
        scale = blocks["scale"].float().unsqueeze(-1)
        if self.levels == "uniform":
            dense = grouped.float() * scale + blocks["offset"].float().unsqueeze(-1)
        else:
            dense = self._codebook(codes.device)[grouped.long()] * scale
        hkv, n, block, d = codes.shape
        flat = dense.reshape(hkv, n, block * d)  # (no -1: a store's first, empty encode)
        flat = flat.scatter(-1, blocks["sparse_idx"].long(), blocks["sparse_val"].float())
        return flat.reshape(codes.shape)

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        """``sqrt(sum over the token's dense entries of b_g^2)`` with ``b_g`` the per-entry
        bound of its group (module docstring); 0 on sparse entries."""
        scale = blocks["scale"].double()  # [Hkv, n, B, d/g]
        if self.levels == "uniform":
            offset = blocks["offset"].double().abs()
            per_entry = scale / 2 + 8 * FP32_EPS * ((1 << self.bits) * scale + offset)
        else:
            per_entry = (self._half_gap() + 8 * FP32_EPS) * scale
        hkv, n, block, groups = scale.shape
        idx = blocks["sparse_idx"].long()
        outliers = torch.zeros(hkv, n, block * groups * self.group, dtype=torch.float64,
                               device=scale.device)
        outliers.scatter_(-1, idx, 1.0)
        dense = self.group - outliers.reshape(hkv, n, block, groups, self.group).sum(dim=-1)
        return _up32((dense * per_entry.square()).sum(dim=-1).sqrt() * (1 + 2.0**-40))

    def decode_rounding(self, head_dim: int | None = None) -> float:
        """Non-uniform: ``L S`` is one product, ``|L S| <= S <= max_group |v|``; two evaluations
        differ by ``2u S`` per entry, ``<= 2u sqrt(g) ||v||`` in l2: ``c = 2.1 sqrt(g)``.
        Uniform: ``q s + o`` rounds twice; ``|q s| + |o| <= (2^b - 1) s + |min| <= 3.003 M +
        2^b 2^-24`` (``s`` rounded up to FP16: ``(max - min)(1 + 2^-10) / (2^b - 1) + 2^-24``;
        ``M`` the group's largest dense magnitude), two evaluations differ by ``4u (1 + u)``
        times that: ``c = max(12.1 sqrt(g), 4.1 2^b)``. Sparse entries are copied exactly."""
        if self.levels == "uniform":
            return max(12.1 * self.group**0.5, 4.1 * (1 << self.bits))
        return 2.1 * self.group**0.5
