"""Pre-RoPE key quantization (KVQuant 3.2): quantize keys before the rotary embedding.

Per-channel key structure (outlier channels, small ranges) lives in the ``k_proj`` output; RoPE
mixes each channel pair ``(j, j + d/2)`` by a position-dependent rotation and smears it. The
cache only ever sees post-RoPE keys, so :class:`PreRoPEKeyCodec` rotates them back with the
model's :class:`~certkv.quant.rope.RopeSpec`, quantizes with a per-channel ``inner`` codec and
rotates the reconstruction forward again on decode.

Notation for one block: post-RoPE FP16 originals ``k [B, d]`` (what the store holds), token
``t`` at position ``p_t = start + t``, ``a = attention_scaling``, ``M_t`` the 2x2 rotations
``[[c, -s], [s, c]]`` of every pair with ``c, s`` the FP64 cosine and sine of the FP64 angle
``p_t w_j``. Then

* encode: ``q = fl64(M_t^T k_t / a)`` (:meth:`RopeSpec.unrotate`), ``q16 = fp16(q)`` (the inner
  codec gets FP16 keys, as its interface promises; a pre-RoPE key beyond the FP16 range is a
  ConfigError), ``inner.encode(q16)``; the block start positions are stored as ``"pos"``
  (int32 ``[Hkv, n]``, 4 bytes per block and kv head, counted in the byte accounting);
* decode: ``k_hat_t = fl32(fl64(a M_t q_hat_t))`` with ``q_hat = inner.decode`` (FP32).

**Bound** (every token of the block, channel ``c`` with partner ``c'``; ``r`` the inner codec's
channel bound, so ``|q16 - q_hat| <= r``): write
``k - k_hat = a M (q16 - q_hat) + a M (q - q16) + (k - a M q) + (a M q_hat - k_hat)``.

1. ``|(a M x)_c| <= a sqrt(c^2 + s^2) sqrt(x_c^2 + x_c'^2)`` (Cauchy-Schwarz), and
   ``c^2 + s^2 <= 1 + 2^-49`` for FP64 cosines and sines (a few ulps each): the quantization
   error contributes ``a R_c`` with ``R_c = sqrt(r_c^2 + r_c'^2)`` (the same for ``c'``).
2. FP16 rounding (possibly double, through FP32): ``|q - q16| <= (2^-11 + 2^-24) |q| + 2^-25``,
   so ``a ((2^-11 + 2^-24) ||q_pair|| + 2^-24.5)``.
3. The FP64 rotation back and forth (``M M^T = (1 + O(2^-50)) I``, the same angles on both sides):
   below ``2^-48 a ||q_pair||``.
4. Decode: FP64 rotation (``2^-50`` relative) and the final FP32 rounding, at most
   ``2^-24 a ||q_hat_pair|| + 2^-150``.

With ``P_c = max_t ||q_hat_pair,t||`` (from the stored codes: the inner decode) and
``||q_pair|| <= (P_c + R_c + 2^-24.5) / (1 - 2^-11)``, the sum is at most

    channel_bound_c = a (R_c + (2^-11 + 2^-19) (P_c + R_c) + 2^-24) + 2^-148,

evaluated in FP64 (inflated by ``2^-40``) and rounded up to FP32. ``decode_slack`` bounds any FP32
evaluation of the decode from the same codes (the inner decode within the inner ``decode_slack``
``sigma``, FP32 cosines and sines of the stored angles, FMA or not): ``a (S_c + 2^-20 (P_c +
S_c)) + 2^-148`` with ``S_c = sqrt(sigma_c^2 + sigma_c'^2)``.

The rotation back uses the codec's own FP64 angles, not the model's FP32 ones (which differ by
about ``2^-24 p w`` radians at position ``p``), so the pre-RoPE keys the inner codec sees are the
``k_proj`` outputs only up to that tiny rotation. That affects quantization quality at most,
never validity: the bound compares the decode with the stored post-RoPE originals, and decode
rotates forward with exactly the angles encode rotated back with.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from certkv.errors import ConfigError, require
from certkv.quant.base import Blocks, KeyCodec, LayerContext
from certkv.quant.int8_channel import ChannelAffineKeyCodec
from certkv.quant.layout import CodeLayout, keeps
from certkv.registry import KEY_CODECS

if TYPE_CHECKING:  # certkv.models imports the cache, which imports certkv.quant
    from certkv.quant.rope import RopeSpec

KEY_MODES = ("pre_rope", "post_rope")
_REL = 2.0**-11 + 2.0**-19  # FP16 rounding of the pre-RoPE keys + every FP32/FP64 rounding
_ABS = 2.0**-24  # FP16 subnormal spacing of the pre-RoPE keys (per unit of attention_scaling)
_SLACK_REL = 2.0**-20  # an FP32 rotation (rounded cos/sin, products, sum, scaling) vs this one
_TINY = 2.0**-148  # FP32 subnormal roundings of the output
_FP16_LIMIT = 65520.0  # magnitudes from here on round to inf in FP16
_NO_ROPE = ("PreRoPEKeyCodec (key_mode=pre_rope) has no rotary embedding: build the cache "
            "through certkv's Prefill or pass KVQuantizer.with_rope(rope_spec(model)), or use "
            "key_mode=post_rope.")


def _up32(x: torch.Tensor) -> torch.Tensor:
    """Non-negative FP64 -> FP32, never below ``x``: inflate past one FP32 rounding (and the
    FP64 evaluation of the bound formulas) before rounding to nearest."""
    return (x * (1 + 2.0**-21) + 2.0**-149).float()


_TABLES: dict = {}  # (RopeSpec, device) -> every table made (a graph may still read an old one)


def _rope_tables(rope: RopeSpec, device: torch.device, positions: int):
    """:meth:`PreRoPEKeyCodec.rope_tables`: the newest table of ``(rope, device)`` while it
    covers ``positions``, else one of twice the positions (at least 4096), kept with the
    others."""
    made = _TABLES.setdefault((rope, str(device)), [])
    if not made or made[-1][0].shape[0] < positions:
        size = max(4096, 2 * positions)
        theta = rope.angles(torch.arange(size, dtype=torch.float64, device=device))
        made.append((torch.cos(theta).float().contiguous(),
                     torch.sin(theta).float().contiguous()))
    return made[-1]


def _pair_norm(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` -> ``[..., d]``: ``sqrt(x_c^2 + x_c'^2)`` with ``c' = c +- d/2`` (FP64)."""
    half = x.shape[-1] // 2
    norm = torch.hypot(x[..., :half], x[..., half:])
    return torch.cat([norm, norm], dim=-1)


@KEY_CODECS.register("pre_rope")
@dataclass
class PreRoPEKeyCodec(KeyCodec):
    """Keys quantized before RoPE by ``inner`` (a per-channel key codec); ``key_mode=post_rope``
    is the plain ``inner`` codec on the post-RoPE keys, so one config field switches. ``rope`` is
    set by :meth:`KVQuantizer.with_rope` (certkv's ``Prefill`` does it for the loaded model)."""

    inner: KeyCodec = field(default_factory=lambda: ChannelAffineKeyCodec(bits=4))
    key_mode: str = "pre_rope"
    rope: RopeSpec | None = None

    def __post_init__(self) -> None:
        from certkv.quant.rope import RopeSpec

        require(self.key_mode in KEY_MODES, ConfigError,
                f"key_mode={self.key_mode!r} is unknown; use one of {list(KEY_MODES)}.")
        require(isinstance(self.inner, KeyCodec) and not isinstance(self.inner, PreRoPEKeyCodec),
                ConfigError, f"PreRoPEKeyCodec.inner={self.inner!r} must be a per-channel key "
                "codec such as ChannelAffineKeyCodec(bits=4).")
        require(self.rope is None or isinstance(self.rope, RopeSpec), ConfigError,
                f"PreRoPEKeyCodec.rope={self.rope!r} must be a RopeSpec (rope_spec(model)) or "
                "None.")

    @property
    def bits(self) -> int:
        return self.inner.bits

    @property
    def name(self) -> str:
        return f"pre_rope_{self.inner.name}" if self.pre_rope else self.inner.name

    @property
    def pre_rope(self) -> bool:
        return self.key_mode == "pre_rope"

    def validate(self, head_dim: int, block_size: int) -> None:
        self.inner.validate(head_dim, block_size)
        if not self.pre_rope:
            return
        require(head_dim % 2 == 0, ConfigError,
                f"key_mode=pre_rope needs an even head_dim (RoPE pairs channels), not "
                f"{head_dim}; use key_mode=post_rope.")
        require(self.rope is None or self.rope.head_dim == head_dim, ConfigError,
                f"the rotary embedding is for head_dim={self.rope and self.rope.head_dim} but the "
                f"layer has head_dim={head_dim}; pass the rope_spec of the model you run.")

    def _rope(self) -> RopeSpec:
        require(self.rope is not None, ConfigError, _NO_ROPE)
        return self.rope

    @staticmethod
    def _inner_blocks(blocks: Blocks) -> Blocks:
        return {name: t for name, t in blocks.items() if name != "pos"}

    def _positions(self, pos: torch.Tensor, block_size: int) -> torch.Tensor:
        """Block starts ``[..., n]`` -> token positions ``[..., n, B]`` (int64)."""
        return pos.long().unsqueeze(-1) + torch.arange(block_size, device=pos.device)

    # ------------------------------------------------------------------ codec interface
    def encode(self, k: torch.Tensor) -> Blocks:
        if not self.pre_rope:
            return self.inner.encode(k)
        raise ConfigError("PreRoPEKeyCodec.encode has no block positions (pre-RoPE keys depend "
                          "on them); call encode_at(k, start) with each block's first position, "
                          "as the store does.")

    def stored_layout(self, block_size: int, head_dim: int) -> Blocks:
        """The inner codec's layout: pre-RoPE keys are stored as it stores keys."""
        return self.inner.stored_layout(block_size, head_dim)

    def encode_at(self, k: torch.Tensor, start: torch.Tensor,
                  layer: LayerContext | None = None) -> Blocks:
        """FP16 post-RoPE keys ``[Hkv, n, B, d]`` whose blocks start at positions ``start [n]``
        (``layer`` is passed on to the inner codec for post-RoPE keys)."""
        if not self.pre_rope:
            return self.inner.encode_at(k, start, layer)
        hkv, n = k.shape[:2]
        start = torch.as_tensor(start, device=k.device).to(torch.int64).reshape(n)
        pre = self._unrotated(k, start)
        blocks = dict(self.inner.encode(pre.to(torch.float16)))
        require("pos" not in blocks, ConfigError,
                f"inner codec {self.inner.name!r} already stores a 'pos' tensor; use another "
                "inner codec.")
        blocks["pos"] = start.to(torch.int32).expand(hkv, n).contiguous()
        return blocks

    def check_encodable(self, k: torch.Tensor, start: torch.Tensor) -> None:
        """Raise (one sentence) where the keys, unrotated, leave FP16's range."""
        if self.pre_rope:
            self._unrotated(k, torch.as_tensor(start, device=k.device).to(torch.int64))

    def _unrotated(self, k: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """FP64 pre-RoPE keys ``[Hkv, n, B, d]`` of post-RoPE ``k`` (blocks starting at
        ``start [n]``), checked to fit FP16."""
        rope = self._rope()
        n, block, d = k.shape[1:]
        require(rope.head_dim == d, ConfigError,
                f"the rotary embedding is for head_dim={rope.head_dim} but the keys have "
                f"head_dim={d}; pass the rope_spec of the model you run.")
        start = start.reshape(n)
        if n:
            require(int(start.min()) >= 0 and int(start.max()) + block < 2**31, ConfigError,
                    "block start positions must lie in [0, 2^31 - B); pass the sequence "
                    "positions of each block's first token.")
        pre = rope.unrotate(k, self._positions(start, block))  # FP64 [Hkv, n, B, d]
        require(not bool(((pre.abs() >= _FP16_LIMIT) & torch.isfinite(pre)).any()), ConfigError,
                "pre-RoPE keys exceed the FP16 range (|k| / attention_scaling near 65504); use "
                "key_mode=post_rope.")
        return pre

    def kernel_layout(self) -> CodeLayout | None:
        """Pre-RoPE keys: the inner codec's plain per-channel affine layout, rotated forward in
        registers (:class:`~certkv.quant.layout.CodeLayout`'s ``rope``), where the inner codec
        states its ``decode_slack`` coefficients; post-RoPE keys: the inner codec's layout."""
        inner = self.inner.kernel_layout()
        if not self.pre_rope:
            return inner
        plain = inner is not None and not (inner.fp16 or inner.token_scale or inner.inner
                                           or inner.norm or inner.subspaces or inner.rope)
        if not (plain and self.rope is not None and keeps(self, PreRoPEKeyCodec)
                and hasattr(self.inner, "slack_coefficients")):
            return None
        return replace(inner, rope=True, slack=tuple(self.inner.slack_coefficients()))

    def kernel_blocks(self, blocks: Blocks, block_size: int) -> Blocks:
        """The inner codec's kernel blocks, with the block start positions (``pos``)."""
        if not self.pre_rope:
            return self.inner.kernel_blocks(blocks, block_size)
        return {**self.inner.kernel_blocks(self._inner_blocks(blocks), block_size),
                "pos": blocks["pos"]}

    def rope_tables(self, positions: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 ``(cos, sin) [P, d/2]`` (``P >= positions``) of the FP64 angles this codec
        rotates with, rounded once: what a kernel's rotation reads at each token's position
        (``decode_slack`` covers their rounding), made once per RoPE, device and doubling of
        ``P``."""
        return _rope_tables(self._rope(), torch.device(device), positions)

    def decode(self, blocks: Blocks) -> torch.Tensor:
        if not self.pre_rope:
            return self.inner.decode(blocks)
        pre = self.inner.decode(self._inner_blocks(blocks))
        return self._rope().rotate(pre, self._positions(blocks["pos"], pre.shape[-2])).float()

    def _magnitude(self, blocks: Blocks) -> torch.Tensor:
        """``P [Hkv, n, d]``: ``max_t ||q_hat_pair,t||`` of the inner reconstruction (FP64)."""
        pre = self.inner.decode(self._inner_blocks(blocks)).double()
        return _pair_norm(pre).amax(dim=-2)

    def channel_bound(self, blocks: Blocks) -> torch.Tensor:
        """``a (R + (2^-11 + 2^-19)(P + R) + 2^-24) + 2^-148`` per channel (module docstring);
        ``P`` comes from the codes, so this costs one inner decode (the store caches the bound
        in its decoded mirror where it keeps one)."""
        if not self.pre_rope:
            return self.inner.channel_bound(blocks)
        a = self._rope().attention_scaling
        r = _pair_norm(self.inner.channel_bound(self._inner_blocks(blocks)).double())
        p = self._magnitude(blocks)
        return _up32(a * (r + _REL * (p + r) + _ABS) + _TINY)

    def decode_slack(self, blocks: Blocks) -> torch.Tensor:
        """``a (S + 2^-20 (P + S)) + 2^-148`` with ``S`` the pair norm of the inner slack."""
        if not self.pre_rope:
            return self.inner.decode_slack(blocks)
        a = self._rope().attention_scaling
        s = _pair_norm(self.inner.decode_slack(self._inner_blocks(blocks)).double())
        p = self._magnitude(blocks)
        return _up32(a * (s + _SLACK_REL * (p + s)) + _TINY)
