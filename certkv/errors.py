"""User-facing errors: each message is one sentence that names the fix."""

from __future__ import annotations


class CertKVError(ValueError):
    """Base class for errors a user can cause (bad shapes, bad config, missing data)."""


class ShapeError(CertKVError):
    """A tensor has the wrong rank, size or head layout."""


class ConfigError(CertKVError):
    """A component was built with an invalid parameter."""


class NonFiniteError(CertKVError):
    """An input holds NaN or Inf."""


class EmptyStoreError(CertKVError):
    """Attention was asked of a store that holds no tokens."""


class Tier2UnavailableError(CertKVError):
    """FP16 originals needed for promotion or fallback are missing: never answer uncertified."""


class BudgetError(CertKVError):
    """Tier-1 cannot fit its configured byte budget even with every block at its last stage."""


def require(condition: bool, error: type[CertKVError], message: str) -> None:
    """Raise ``error(message)`` unless ``condition`` holds."""
    if not condition:
        raise error(message)


def require_known(node: dict, allowed, where: str, hint: str = "") -> None:
    """One sentence naming ``node``'s keys outside ``allowed`` (a config mapping ``where``,
    e.g. ``hf_cache``) and the keys it may set; ``hint`` follows them."""
    unknown = set(node) - set(allowed)
    require(not unknown, ConfigError,
            f"{where} has unknown keys {sorted(unknown)}; it may set {', '.join(allowed)}{hint}.")
