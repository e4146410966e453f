"""Certificate-driven tier boundaries (seed 004's adaptive thresholds, certified).

Seed 004 moves its hot / warm boundaries by a heuristic quality score (and inverts the direction
of its perplexity target). certkv moves them by what the certificates measured. Every ``window``
decode steps of a layer (seed 004 averages its last 100 scores):

* **archive more** when the steps were cheap and tight: at most ``promotion_rate`` of the heads
  needed FP16 values or more (rung >= 2), at most ``dense_rate`` went dense (rung >= 3), and the
  mean returned quantization bound ``E_key + E_val`` stayed at most ``bound_target``: both
  boundaries shrink by ``shrink`` (blocks graduate younger);
* **archive less** when promotions exceeded twice ``promotion_rate``, dense heads exceeded
  ``dense_rate`` or the mean bound exceeded ``bound_target``: both grow by ``grow``;
* otherwise they stay. ``hot`` stays within ``hot_limits`` and ``stale`` within
  ``stale_limits`` (and ``hot <= stale``).

New boundaries apply to blocks that graduate from then on (no block returns to a finer
precision). Every decision reads the accumulated counts once per window (no per-step host read).
:func:`save` / :func:`load` persist the boundaries per model and layer (JSON), as the seed's
threshold store does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from certkv.errors import ConfigError, require
from certkv.files import write_atomic


@dataclass
class AdaptiveThresholds:
    """The rule's settings (``quantizer.adaptive``); :meth:`tracker` makes one layer's state."""

    window: int = 100
    bound_target: float = 0.05
    promotion_rate: float = 0.05
    dense_rate: float = 0.01
    grow: float = 1.2
    shrink: float = 0.9
    hot_limits: list = field(default_factory=lambda: [32, 256])
    stale_limits: list = field(default_factory=lambda: [128, 4096])

    def __post_init__(self) -> None:
        require(isinstance(self.window, int) and self.window >= 1, ConfigError,
                f"adaptive.window={self.window!r} must be a positive number of steps, e.g. 100.")
        require(self.grow > 1 and 0 < self.shrink < 1, ConfigError,
                f"adaptive.grow={self.grow} must exceed 1 and adaptive.shrink={self.shrink} lie "
                "in (0, 1), e.g. 1.2 and 0.9.")
        for name in ("hot_limits", "stale_limits"):
            lo, hi = getattr(self, name)
            require(0 <= lo <= hi, ConfigError,
                    f"adaptive.{name}={[lo, hi]} must be [low, high] with 0 <= low <= high.")

    def tracker(self, ages: list[int]) -> ThresholdTracker:
        return ThresholdTracker(self, ages)


class ThresholdTracker:
    """One layer's window of certificate counts; moves ``ages = [hot, stale]`` in place."""

    def __init__(self, rule: AdaptiveThresholds, ages: list[int]) -> None:
        self.rule, self.ages = rule, ages
        self.steps = 0
        self._sums: torch.Tensor | None = None  # heads, rung >= 2, rung >= 3, sum of bounds
        self.history: list[dict] = []  # one entry per decision

    def observe(self, certificate) -> None:
        """Accumulate one step's certificate (device ops only); decide every ``window``."""
        rung = certificate.rung
        sums = torch.stack([torch.tensor(float(rung.numel()), device=rung.device),
                            (rung >= 2).sum().float(), (rung >= 3).sum().float(),
                            (certificate.e_key + certificate.e_val).sum().float()])
        self._sums = sums if self._sums is None else self._sums + sums
        self.steps += 1
        if self.steps % self.rule.window == 0:
            self._decide(self._sums.tolist())
            self._sums = None

    def _decide(self, sums: list[float]) -> None:
        heads, promoted, dense, bound = sums
        rule = self.rule
        rates = {"promotion": promoted / heads, "dense": dense / heads, "bound": bound / heads}
        if (rates["promotion"] <= rule.promotion_rate and rates["dense"] <= rule.dense_rate
                and rates["bound"] <= rule.bound_target):
            factor, verdict = rule.shrink, "archive more"
        elif (rates["promotion"] > 2 * rule.promotion_rate or rates["dense"] > rule.dense_rate
              or rates["bound"] > rule.bound_target):
            factor, verdict = rule.grow, "archive less"
        else:
            factor, verdict = 1.0, "keep"
        hot = _clamp(_scaled(self.ages[0], factor), rule.hot_limits)
        stale = max(hot, _clamp(_scaled(self.ages[1], factor), rule.stale_limits))
        self.ages[:] = [hot, stale]
        self.history.append({"step": self.steps, **rates, "verdict": verdict, "hot": hot,
                             "stale": stale})


def _scaled(age: int, factor: float) -> int:
    """``age * factor`` rounded, moving by at least one token when ``factor != 1``."""
    if factor == 1.0:
        return age
    moved = round(age * factor)
    return max(moved, age + 1) if factor > 1 else max(min(moved, age - 1), 0)


def _clamp(x: int, limits: list) -> int:
    return int(min(max(x, limits[0]), limits[1]))


def save(path: str | Path, model: str, boundaries: dict[int, list[int]]) -> None:
    """Write ``boundaries`` (layer -> ``[hot, stale]``) for ``model`` into the JSON file at
    ``path`` (other models' entries kept; written atomically)."""
    path = Path(path)
    data = json.loads(path.read_text()) if path.exists() else {}
    data[model] = {str(layer): {"hot": b[0], "stale": b[1]} for layer, b in boundaries.items()}
    write_atomic(path, json.dumps(data, indent=1, sort_keys=True) + "\n")


def load(path: str | Path, model: str) -> dict[int, list[int]]:
    """Layer -> ``[hot, stale]`` saved for ``model`` at ``path``."""
    path = Path(path)
    require(path.exists(), ConfigError,
            f"no threshold file at {path}; run once with quantizer.adaptive set and save, or drop "
            "the thresholds path.")
    data = json.loads(path.read_text())
    require(model in data, ConfigError,
            f"{path} holds thresholds for {sorted(data)}, not for model {model!r}; save them for "
            "this model first.")
    return {int(layer): [b["hot"], b["stale"]] for layer, b in data[model].items()}
