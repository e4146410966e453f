"""The model's rotary position embedding (RoPE) as a small value object, for pre-RoPE key codecs.

transformers' LLaMA family (LLaMA, Mistral, Qwen2, SmolLM2) rotates each key ``k [d]`` at
position ``p`` with ``cos = cos(p w) a``, ``sin = sin(p w) a`` (``w = inv_freq [d/2]``, ``a =
attention_scaling``, both halves of the head sharing the frequencies) and ``rotate_half``::

    k'[j]       = a (k[j] cos(p w_j) - k[j + d/2] sin(p w_j))
    k'[j + d/2] = a (k[j + d/2] cos(p w_j) + k[j] sin(p w_j))        j < d/2

i.e. ``k' = a R(p w) k`` with a 2x2 rotation per channel pair ``(j, j + d/2)``. The inverse is
``k = R(-p w) k' / a``. :class:`RopeSpec` evaluates both in FP64 with angles ``p * w`` computed in
FP64 from the model's (FP32) ``inv_freq``; the model itself computes them in FP32, which differs by
about ``2^-24 p w`` radians (a codec that rotates back and forth with its own angles stays exact,
whatever the model did).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from certkv.errors import ConfigError, require


@dataclass(frozen=True)
class RopeSpec:
    """A model's RoPE: ``inv_freq`` (``d/2`` floats; a tensor is converted to a tuple of FP64
    values, so specs hash and compare by value), ``attention_scaling`` (``a`` above) and
    ``head_dim`` (``d``, default ``2 len(inv_freq)``; only full-width RoPE is supported)."""

    inv_freq: tuple[float, ...]
    attention_scaling: float = 1.0
    head_dim: int | None = None

    def __post_init__(self) -> None:
        freq = self.inv_freq
        if isinstance(freq, torch.Tensor):
            freq = freq.detach().to("cpu", torch.float64).reshape(-1).tolist()
        freq = tuple(float(f) for f in freq)
        object.__setattr__(self, "inv_freq", freq)
        object.__setattr__(self, "attention_scaling", float(self.attention_scaling))
        head_dim = 2 * len(freq) if self.head_dim is None else int(self.head_dim)
        object.__setattr__(self, "head_dim", head_dim)
        require(len(freq) >= 1 and all(math.isfinite(f) for f in freq), ConfigError,
                "RopeSpec.inv_freq must hold head_dim / 2 finite frequencies; pass the model's "
                "rotary_emb.inv_freq.")
        require(math.isfinite(self.attention_scaling) and self.attention_scaling > 0, ConfigError,
                f"RopeSpec.attention_scaling={self.attention_scaling} must be a positive finite "
                "number such as 1.0.")
        require(head_dim == 2 * len(freq), ConfigError,
                f"RopeSpec has {len(freq)} frequencies for head_dim={head_dim}: only full-width "
                "RoPE (head_dim / 2 frequencies) is supported; use key_mode=post_rope.")

    @classmethod
    def from_theta(cls, theta: float, head_dim: int, attention_scaling: float = 1.0) -> RopeSpec:
        """The default RoPE of base ``theta`` as transformers computes it (FP32 ``inv_freq``)."""
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return cls(1.0 / (theta**exponent), attention_scaling, head_dim)

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        """FP64 ``positions [...]`` (any integer or float dtype) -> FP64 angles ``[..., d/2]``."""
        freq = torch.tensor(self.inv_freq, dtype=torch.float64, device=positions.device)
        return positions.to(torch.float64).unsqueeze(-1) * freq

    def _turn(self, x: torch.Tensor, positions: torch.Tensor, sign: float,
              factor: float) -> torch.Tensor:
        theta = self.angles(positions)
        cos, sin = torch.cos(theta), sign * torch.sin(theta)
        x = x.to(torch.float64)
        half = self.head_dim // 2
        a, b = x[..., :half], x[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
        return out * factor if factor != 1.0 else out

    def rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE ``x [..., d]`` at ``positions [...]`` (broadcastable) -> post-RoPE, FP64:
        ``a R(p w) x``, what the model's ``apply_rotary_pos_emb`` computes."""
        return self._turn(x, positions, 1.0, self.attention_scaling)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Post-RoPE ``x [..., d]`` -> pre-RoPE, FP64: ``R(-p w) x / a`` (the ``k_proj`` output)."""
        return self._turn(x, positions, -1.0, 1.0 / self.attention_scaling)


def rope_spec(model) -> RopeSpec | None:
    """The :class:`RopeSpec` of a transformers LLaMA-family model (``model.model.rotary_emb``'s
    ``inv_freq`` and ``attention_scaling``), or None if it has no standard full-width rotary
    embedding. Dynamic RoPE variants report their current frequencies: a codec using them stays
    valid (it rotates back with the same angles), only its pre-RoPE view is approximate."""
    base = getattr(model, "model", model)
    rotary = getattr(base, "rotary_emb", None)
    inv_freq = getattr(rotary, "inv_freq", None)
    if not isinstance(inv_freq, torch.Tensor) or inv_freq.dim() != 1:
        return None
    config = getattr(model, "config", None)
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and config is not None:
        head_dim = config.hidden_size // config.num_attention_heads
    if head_dim is not None and head_dim != 2 * inv_freq.numel():
        return None  # partial rotary: not supported by pre-RoPE codecs
    scaling = getattr(rotary, "attention_scaling", None)
    return RopeSpec(inv_freq, 1.0 if scaling is None else float(scaling), head_dim)
