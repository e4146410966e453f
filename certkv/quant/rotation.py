"""Rotated codecs: an exact orthogonal basis, then per-subspace 2-bit quantization ("SQuat").

Seed 004 describes "SQuat" as an orthogonal per-layer basis, the rotated vectors split into
``m`` subspaces (4-8) with one scale each, at 2 bits: rotation plus low-bit quantization, which
spreads outlier channels over all coordinates. Here the basis is the **unnormalised Sylvester
Hadamard matrix** ``H`` (entries +-1, ``H = H^T``, ``H^T H = d I``, ``d`` a power of two) times,
for ``rotation="random_hadamard"``, a diagonal ``D`` of random signs drawn from ``seed``:
``H D / sqrt(d)`` is a random orthogonal basis from the randomized-Hadamard family (QuaRot,
QuIP#). One basis per codec: layers that share a codec share it (a per-layer basis is a
per-layer ``seed``). A general random orthogonal matrix is not used on purpose: its entries
are irrational, so neither it nor its inverse is exact in floating point, the computed
rotation is only approximately orthogonal and the certified bound would have to carry that
error; with ``+-1`` entries every step below is exact.

**Encode** (token by token): ``z = H D k / d`` in FP64 (exact, below), split into ``m``
subspaces of ``g = d / m`` consecutive coordinates; subspace ``j`` stores the FP16 zero-point
``o_j`` (its minimum rounded *down* to FP16) and the FP16 scale ``s_j`` (``(max - o_j) / (2^b -
1)`` rounded up, with ``(2^b - 1) s_j >= max - o_j`` checked exactly), and unsigned ``b``-bit
codes ``q = round((z - o_j) / s_j)``. The ``1 / d`` keeps ``|z| <= max_c |k_c| <= 65504``, so
FP16 metadata never overflows. **Decode**: ``z_hat = q s + o``, ``k_hat = D H^T z_hat`` in FP64,
returned as FP32 (``k = D H^T z`` because ``H^T H = d I``). Tier-1 holds ``d b / 8`` code bytes
and ``4 m`` metadata bytes per token: ``16 + 16 = 32`` at ``d = 64, m = 4, b = 2``.

**Exactness in FP64** (``d <= 256``, enforced). FP16 numbers are multiples of ``2^-24`` below
``2^16``; ``d z = H D k`` and every partial sum of it (any order: products are by ``+-1``) are
multiples of ``2^-24`` below ``2^24``, so at most 48 bits: exact; ``/ d`` is exact. ``z - o_j``
and ``max - o_j`` (multiples of ``2^-32`` below ``2^17``) are exact, and so is ``q s + o`` (a
multiple of ``2^-24`` below ``2^18``) and every partial sum of ``H^T z_hat`` (below ``2^26``).
The only FP64 rounding is the quotient ``(z - o_j) / s_j`` (relative ``2^-53``).

**No clipping**: ``0 <= z - o_j <= max - o_j <= (2^b - 1) s_j`` exactly and correctly rounded
division is monotone, so the quotient lies in ``[0, 2^b - 1]`` (subnormal scales included: a
positive spread rounds up to at least ``2^-24``); the code clamp is never active. Each rotated
coordinate is then reconstructed within ``e_j = |z_j - z_hat_j| <= s_j (1/2 + 2^-45)``.

**Bounds** (``u = 2^-24``; per token ``t``; ``zmax_j = max(|o_j|, |o_j + (2^b - 1) s_j|)``
bounds ``|z_hat|`` and ``|z|`` over subspace ``j``; ``N_t = g sum_j zmax_j >= ||z_hat||_1``):

* values: ``v - v_hat = D H^T (z - z_hat)`` and ``||H^T x||_2 = sqrt(d) ||x||_2``, so
  ``||v - v_hat||_2 <= sqrt(d) sqrt(g sum_j (s_j / 2)^2) (1 + 2^-44)``; the FP32 cast adds at
  most ``u ||v_hat||_2 <= u sqrt(d) sqrt(g sum_j zmax_j^2)``. Stated:
  ``token_bound = (1 + 2^-20) sqrt(d) sqrt(g sum_j (s_j / 2)^2) + 4u sqrt(d) sqrt(g sum_j
  zmax_j^2)``;
* keys, per channel: ``|(D H^T e)_c| <= sum_i |e_i|`` (every entry of ``D H^T`` is +-1, and the
  box ``|e_i| <= s_i / 2`` attains it), so ``|k_c - k_hat_c| <= g sum_j s_j / 2 (1 + 2^-44) +
  u N_t``: the same for every channel. A channel bound holds for every token of the block, so
  ``channel_bound = max_t [(1 + 2^-20) g sum_j s_tj / 2 + 4u N_t]`` (tighter than summing the
  per-subspace maxima over tokens).

The ``1 + 2^-20`` (for ``1 + 2^-44``) and the ``4u`` (for ``u``) leave room for the bounds'
own evaluation (FP64, then rounded up to FP32). A token whose subspaces all have ``s_j = 0``
(each constant and FP16-exact, e.g. a zero vector) reconstructs exactly: its bound is 0. Any
FP32 evaluation of decode (a fused kernel's, any summation order, FMA or not) computes each
``z_hat_j`` within ``u |z_hat_j|`` (``q s`` is exact) and each channel, a signed sum of ``d`` of
them, within ``gamma_d ||z_hat||_1 <= gamma_d N_t`` of the exact one; this codec's own decode
is within ``u N_t``: hence the keys' ``decode_slack = (d + 2) u max_t N_t`` and the values'
:meth:`RotatedValueCodec.decode_rounding`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import (
    FP32_EPS,
    Blocks,
    KeyCodec,
    ValueCodec,
    round_down_fp16,
    round_up_fp32,
)
from certkv.quant.kivi import fp16_step
from certkv.quant.layout import KERNEL_BITS, CodeLayout, keeps
from certkv.quant.packing import check_bits, check_packable, pack_bits, unpack_bits
from certkv.registry import KEY_CODECS, VALUE_CODECS, inherits

ROTATIONS = ("hadamard", "random_hadamard")
MAX_HEAD_DIM = 256  # FP64 encode and decode are exact up to here (module docstring)

_REL = 1 + 2.0**-20  # relative headroom on the half steps (exact error: 1 + 2^-44)
_MAG = 4 * FP32_EPS  # headroom on the magnitude: the FP32 cast (u) with room to spare
# the kernels evaluate the keys' channel bound in FP32 over the subspaces: the relative
# headroom _REL covers that evaluation for up to this many (module docstring of quant.layout)
KERNEL_SUBSPACES = 8


@lru_cache(maxsize=32)
def _kernel_basis(rotation: str, seed: int, d: int, device: str) -> torch.Tensor:
    """FP32 ``H D [d, d]`` (entries +-1, exact) on ``device``, made once per codec setting."""
    return _Rotated(rotation=rotation, seed=seed).basis(d).float().to(device)


def hadamard(d: int, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """The unnormalised Sylvester Hadamard matrix ``[d, d]`` (``d`` a power of two): entries
    +-1, symmetric, ``H^T H = d I``; ``H_{2n} = [[H_n, H_n], [H_n, -H_n]]``."""
    require(d >= 1 and d & (d - 1) == 0, ConfigError,
            f"a Hadamard matrix of order {d} is not built; use a power of two such as 64.")
    h = torch.ones(1, 1, dtype=dtype, device=device)
    while h.shape[0] < d:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h


def fwht(x: torch.Tensor) -> torch.Tensor:
    """``x @ H^T`` (= ``H x`` per vector) along the last dimension, a power of two: the fast
    Walsh-Hadamard transform in the Sylvester order of :func:`hadamard`, ``log2 d`` stages of
    sums and differences (exact in FP64 for the inputs of this module)."""
    d = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < d:
        pairs = x.reshape(*lead, d // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), dim=-2).reshape(*lead, d)
        h *= 2
    return x


@dataclass
class _Rotated:
    """What the key and value codecs share: the basis, encode and decode, the bound terms."""

    bits: int = 2
    subspaces: int = 4
    rotation: str = "random_hadamard"
    seed: int = 0

    def __post_init__(self) -> None:
        check_bits(self.bits)
        require(isinstance(self.subspaces, int) and self.subspaces >= 1, ConfigError,
                f"subspaces={self.subspaces!r} must be a positive integer such as 4.")
        require(self.rotation in ROTATIONS, ConfigError,
                f"rotation={self.rotation!r} is not supported; use one of {ROTATIONS}.")

    @property
    def levels(self) -> int:
        """The largest code, ``2^bits - 1``."""
        return (1 << self.bits) - 1

    def validate(self, head_dim: int, block_size: int) -> None:
        kind = "key" if isinstance(self, KeyCodec) else "value"
        require(head_dim >= 1 and head_dim & (head_dim - 1) == 0, ConfigError,
                f"head_dim={head_dim} is not a power of two, which the Hadamard rotation "
                f"needs; use the {kind} codec int8_channel or int4_group for this model.")
        require(head_dim <= MAX_HEAD_DIM, ConfigError,
                f"head_dim={head_dim} exceeds {MAX_HEAD_DIM}, the largest for which the "
                f"rotation is exact in FP64; use the {kind} codec int8_channel or int4_group.")
        require(head_dim % self.subspaces == 0, ConfigError,
                f"subspaces={self.subspaces} does not divide head_dim={head_dim}; use a power "
                f"of two no larger than {head_dim}, e.g. subspaces={min(4, head_dim)}.")
        check_packable(head_dim, self.bits, kind)

    def signs(self, d: int, device=None) -> torch.Tensor:
        """The diagonal of ``D`` (FP64 ``[d]`` of +-1): all ones for ``"hadamard"``, seeded
        random signs for ``"random_hadamard"``."""
        if self.rotation == "hadamard":
            return torch.ones(d, dtype=torch.float64, device=device)
        gen = torch.Generator().manual_seed(self.seed)
        bits = torch.randint(0, 2, (d,), generator=gen)
        return (1 - 2 * bits).to(dtype=torch.float64, device=device)

    def basis(self, d: int, device=None) -> torch.Tensor:
        """``H D`` (FP64 ``[d, d]``): ``z = H D k / d`` and ``k = (H D)^T z``."""
        return hadamard(d, device=device) * self.signs(d, device)

    def _head_dim(self, blocks: Blocks) -> int:
        return blocks["codes"].shape[-1] * 8 // self.bits

    def _encode(self, x: torch.Tensor) -> Blocks:
        d = x.shape[-1]
        self.validate(d, x.shape[-2])  # exactness needs a power of two <= MAX_HEAD_DIM
        z = fwht(x.to(torch.float16).double() * self.signs(d, x.device)) / d  # exact
        sub = z.reshape(*z.shape[:-1], self.subspaces, d // self.subspaces)
        lo = round_down_fp16(sub.amin(dim=-1))  # FP16 [Hkv, n, B, m]
        lo64 = lo.double()
        scale = fp16_step(sub.amax(dim=-1) - lo64, self.levels)  # exact spread
        safe = torch.where(scale > 0, scale.double(), torch.ones_like(lo64))
        codes = torch.round((sub - lo64.unsqueeze(-1)) / safe.unsqueeze(-1))
        codes = codes.clamp(0, self.levels).reshape(z.shape).to(torch.uint8)  # never active
        return {"codes": pack_bits(codes, self.bits), "scale": scale, "offset": lo}

    def _decode(self, blocks: Blocks) -> torch.Tensor:
        codes = unpack_bits(blocks["codes"], self.bits).double()
        d = codes.shape[-1]
        sub = codes.reshape(*codes.shape[:-1], self.subspaces, d // self.subspaces)
        scale = blocks["scale"].double().unsqueeze(-1)
        offset = blocks["offset"].double().unsqueeze(-1)
        z_hat = (sub * scale + offset).reshape(codes.shape)  # exact
        out = fwht(z_hat) * self.signs(d, codes.device)  # D H^T z_hat, exact (H^T = H)
        return out.float()

    def _layout(self, owner: type) -> CodeLayout | None:
        """Per-token affine codes of rotated coordinates (:class:`CodeLayout`'s
        ``subspaces``), 2/3/4/8 bits and up to :data:`KERNEL_SUBSPACES` subspaces; the keys'
        ``(a, b)`` of :meth:`RotatedKeyCodec.channel_bound` per subspace width."""
        same = keeps(self, owner) and inherits(self, owner, "_encode", "_decode", "basis",
                                                "signs", "decode_slack")
        if not same or self.bits not in KERNEL_BITS or self.subspaces > KERNEL_SUBSPACES:
            return None
        return CodeLayout(False, self.bits, bound=(_REL / 2, _MAG), subspaces=self.subspaces)

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The stored tensors (views) and the basis ``H D`` in FP32 (``basis [d, d]``)."""
        return {**blocks, "basis": _kernel_basis(self.rotation, self.seed, self._head_dim(blocks),
                                                 str(blocks["codes"].device))}

    def _terms(self, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """FP64 ``(s_j, zmax_j, exact_t, g)``: scales and magnitude bounds ``[Hkv, n, B, m]``,
        where a token reconstructs exactly ``[Hkv, n, B]``, the subspace width."""
        scale = blocks["scale"].double()
        offset = blocks["offset"].double()
        zmax = torch.maximum(offset.abs(), (offset + self.levels * scale).abs())
        return scale, zmax, (scale == 0).all(dim=-1), self._head_dim(blocks) // self.subspaces


@KEY_CODECS.register("rotated")
@dataclass
class RotatedKeyCodec(_Rotated, KeyCodec):
    """Keys: Hadamard rotation, per token FP16 scale and zero-point per subspace (module
    docstring). Stored per block: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale``
    and ``offset`` FP16 ``[Hkv, n, B, subspaces]``."""

    name: str = "rotated"

    def encode(self, k: torch.Tensor) -> Blocks:
        return self._encode(k)

    def kernel_layout(self) -> CodeLayout | None:
        return self._layout(RotatedKeyCodec)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return self._decode(blocks)

    def _per_channel(self, blocks: Blocks, per_token: torch.Tensor) -> torch.Tensor:
        """FP64 ``[Hkv, n, B]`` -> FP32 ``[Hkv, n, d]``: the max over tokens, rounded up, the
        same for every channel."""
        bound = round_up_fp32(per_token.amax(dim=-1))
        return bound.unsqueeze(-1).expand(*bound.shape, self._head_dim(blocks)).contiguous()

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        """``max_t [(1 + 2^-20) g sum_j s_tj / 2 + 4u N_t]``, 0 for exact tokens."""
        scale, zmax, exact, g = self._terms(blocks)
        per_token = _REL * g * (scale / 2).sum(dim=-1) + _MAG * g * zmax.sum(dim=-1)
        return self._per_channel(blocks, torch.where(exact, 0.0, per_token))

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        """``(d + 2) u max_t N_t``: any FP32 evaluation is within ``gamma_d N_t`` of the exact
        decode, this codec's own within ``u N_t`` (module docstring; ``gamma_d + u <= (d + 2)
        u`` for ``d <= 256``)."""
        _, zmax, _, g = self._terms(blocks)
        d = self._head_dim(blocks)
        return self._per_channel(blocks, (d + 2) * FP32_EPS * g * zmax.sum(dim=-1))


@VALUE_CODECS.register("rotated")
@dataclass
class RotatedValueCodec(_Rotated, ValueCodec):
    """Values: Hadamard rotation, per token FP16 scale and zero-point per subspace (module
    docstring). Stored per block: ``codes`` uint8 ``[Hkv, n, B, d * bits / 8]``, ``scale``
    and ``offset`` FP16 ``[Hkv, n, B, subspaces]``."""

    name: str = "rotated"

    def encode(self, v: torch.Tensor) -> Blocks:
        return self._encode(v)

    def kernel_layout(self, head_dim: int) -> CodeLayout | None:
        return self._layout(RotatedValueCodec)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        return self._decode(blocks)

    def token_bound(self, blocks: Blocks) -> torch.Tensor:
        """``(1 + 2^-20) sqrt(d) sqrt(g sum_j (s_j/2)^2) + 4u sqrt(d) sqrt(g sum_j zmax_j^2)``,
        0 for exact tokens."""
        scale, zmax, exact, g = self._terms(blocks)
        root_d = math.sqrt(self._head_dim(blocks))
        bound = (_REL * root_d * torch.sqrt(g * (scale / 2).square().sum(dim=-1))
                 + _MAG * root_d * torch.sqrt(g * zmax.square().sum(dim=-1)))
        return round_up_fp32(torch.where(exact, 0.0, bound))

    def decode_rounding(self, head_dim: int | None = None) -> float:
        """``c`` of :meth:`ValueCodec.decode_rounding` at ``head_dim`` (default: the largest
        accepted, :data:`MAX_HEAD_DIM`, valid for every head_dim). Any FP32 evaluation errs per
        channel by at most ``gamma_d ||z_hat||_1``, so in l2 by ``sqrt(d) gamma_d ||z_hat||_1
        <= gamma_d sqrt(d) ||v_hat||_2`` (``||z_hat||_1 <= sqrt(d) ||z_hat||_2 = ||v_hat||_2``);
        this codec's own decode is within ``u ||v_hat||_2``. With ``M_j`` the largest ``|z|``
        of subspace ``j`` and ``b >= 2``, the FP16 rounding of zero-point and scale
        (subnormals included) gives ``s_j <= 0.67 M_j + 1.34 * 2^-24``; as ``sum_j g M_j^2 <=
        g ||z||^2``, ``||v - v_hat||_2 <= 0.336 sqrt(g) ||v||_2 + 0.671 * 2^-24 d``, so
        ``||v_hat||_2 <= K (||v||_2 + 2^-24 sqrt(d))`` with ``K = max(1 + 0.336 sqrt(g),
        0.671 sqrt(d))``: ``c = 1.01 (d^1.5 + 1) K`` (about 2800 at ``d = 64, g = 16``)."""
        d = MAX_HEAD_DIM if head_dim is None else head_dim
        g = max(d // self.subspaces, 1)
        return 1.01 * (d**1.5 + 1) * max(1 + 0.34 * math.sqrt(g), 0.68 * math.sqrt(d))
