"""SmartKV (seed 001): attention-guided mixed precision, as a certified quantizer.

Every completed block is held at one width of ``{2, 3, 4, 8}`` bits with seed 001's quantizer
(symmetric, one FP16 scale per token and kv head: :mod:`certkv.quant.symmetric_token`). The
width follows the block's importance, re-allocated every ``f(N) = max(8, min(64, 16 (1 + N /
512)))`` decode steps since the last reallocation, under a memory budget ``beta``:

* **Per block, not per token.** The store holds one precision per block, so SmartKV allocates
  per block, with a block's importance the sum of its tokens' (the EMA is linear, so the EMA of
  the block's attention mass equals the sum of its tokens' EMAs, with no extra pass: the
  certified step already computes every block's mass ``rho_b``). A block's bound is its
  codec's (each token's own scale), so the certificate keeps its form; what changes against
  per-token widths is only granularity (a block of 16 shares one width).
* **Importance** (:class:`~certkv.quant.importance.SmartKVTracker`): per layer the EMA (gamma)
  of the mean over query heads of ``rho_b``; the cross-layer mean; recency decay ``exp(-age /
  T)`` with the age in tokens since the block's newest token (the insertion step, counting a
  prompt's tokens as inserted one per step); head weighting ``I_final = 0.7 I + 0.3
  I_weighted`` with ``I_weighted = mean_h w_h rho_hb``, ``w_h = eta_h / mean(eta)``, ``eta_h
  <- 0.95 eta_h + 0.05 Abar_h`` (``head_signal: mean``: the seed as written, ``Abar_h`` the mean
  attention over tokens = ``1 / N`` for every head, so every ``w_h = 1``; ``max``: the head's
  largest block mass, a non-degenerate signal). ``I`` and ``I_weighted`` are each normalised to
  mean 1 before the mix. Prompt blocks start at importance 0 (prefill runs dense SDPA, whose
  weights are hidden), so the first allocation ranks them by recency.
* **Allocation** (:mod:`certkv.quant.allocation`): ``rule: importance`` is the seed's (tiers by
  rank, the budget pass along the ladder); ``rule: certificate`` spends bits where a block's
  share of the bound is largest (``rho_b (eta_b + 2 R tanh(Delta_b / 2))`` per unit step, EMA
  over steps), greedily by error reduction per bit.
* **Budget**: mean bits per element ``<= 16 beta`` over the unprotected blocks, scales counted
  (``b + 16 / d`` per element: the FP16 scale per token and head). The blocks holding the first
  ``k_critical`` tokens are protected at 8 bits, outside the budget (the store sees positions,
  not token ids: special tokens elsewhere are not recognised), as is the FP16 tail (fewer than
  ``B`` tokens). New blocks enter at 8 bits; if that breaks the budget, the least important
  blocks step down at once, so the budget holds after every step. A ``beta`` below what all-2-bit
  needs is one clear error.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from certkv.errors import ConfigError, require
from certkv.quant.allocation import (
    LADDER,
    realloc_period,  # noqa: F401 (SmartKV's f(N))
)
from certkv.quant.kv import KVQuantizer
from certkv.quant.precision import Precision, exact_precision
from certkv.quant.symmetric_token import TokenSymmetricKeyCodec, TokenSymmetricValueCodec
from certkv.registry import QUANTIZERS

RULES = ("importance", "certificate")
HEAD_SIGNALS = ("mean", "max")


@QUANTIZERS.register("smartkv")
@dataclass
class SmartKVQuantizer(KVQuantizer):
    """SmartKV's widths per block under ``beta`` (module docstring)."""

    key_codec: object = field(default_factory=lambda: TokenSymmetricKeyCodec(8))
    value_codec: object = field(default_factory=lambda: TokenSymmetricValueCodec(8))
    beta: float = 0.4
    rule: str = "importance"
    gamma: float = 0.9
    recency: float = 512.0
    head_mix: float = 0.3
    head_signal: str = "mean"
    k_critical: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.beta <= 1, ConfigError,
                f"beta={self.beta!r} must be in (0, 1] (the fraction of FP16 memory), e.g. 0.4.")
        require(self.rule in RULES, ConfigError,
                f"rule={self.rule!r} is unknown; use one of {RULES}.")
        require(self.head_signal in HEAD_SIGNALS, ConfigError,
                f"head_signal={self.head_signal!r} is unknown; use one of {HEAD_SIGNALS}.")
        require(self.residual == 0 and self.sink == 0, ConfigError,
                "SmartKV keeps no exact windows (its first k_critical tokens are protected at 8 "
                "bits instead); set residual=0 and sink=0.")
        require(0 < self.gamma < 1 and self.recency > 0 and 0 <= self.head_mix <= 1,
                ConfigError, "gamma must be in (0, 1), recency > 0 and head_mix in [0, 1] (the "
                "seed: gamma=0.9, recency=512, head_mix=0.3).")

    def precisions(self) -> list[Precision]:
        """Id 0 exact (the tail), then one precision per width of the ladder."""
        return [exact_precision()] + [
            Precision(TokenSymmetricKeyCodec(b), TokenSymmetricValueCodec(b), f"{b}-bit")
            for b in LADDER]

    def pid(self, bits: int) -> int:
        """The precision id of width ``bits``."""
        return 1 + LADDER.index(bits)

    def stage_ages(self) -> list[int]:
        return []

    def stage_precision(self, stage: int, seq_len: int) -> int:
        return self.pid(8)  # new blocks at 8 bits until the next reallocation

    def cost(self, head_dim: int) -> dict[int, float]:
        """Bits per element of each width: codes plus the FP16 scale per token and head."""
        return {b: b + 16 / head_dim for b in LADDER}

    def budget(self) -> float:
        """The mean bits per element allowed over the unprotected blocks: ``16 beta``."""
        return 16 * self.beta

    def validate(self, head_dim: int) -> None:
        super().validate(head_dim)
        floor = self.cost(head_dim)[LADDER[0]]
        require(floor <= self.budget(), ConfigError,
                f"beta={self.beta} allows {self.budget():.2f} bits per element but 2-bit blocks "
                f"need {floor:.2f} at head_dim={head_dim} (codes and scales); use beta >= "
                f"{floor / 16:.4f}.")

    def new_tracker(self, store):
        from certkv.quant.importance import SmartKVTracker

        return SmartKVTracker(self, store)

    @property
    def label(self) -> str:
        return f"SmartKV beta={self.beta} ({self.rule})"
