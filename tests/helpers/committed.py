"""Reading hand-made report tables back (issue 57's recomputation tests): a cell's numbers and
whether a recomputed value prints as a cell's number."""

from __future__ import annotations

import re

NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def agrees(token: str, value: float) -> bool:
    """Whether ``value`` prints as ``token`` at the token's precision (``0`` stands for a
    bound of exactly zero, as a CI's end at no change)."""
    if token == "0":
        return value == 0.0
    if "e" in token:
        mantissa, exponent = token.split("e")
        digits = len(mantissa.split(".")[1]) if "." in mantissa else 0
        return abs(value - float(token)) <= 0.5 * 10 ** (int(exponent) - digits)
    digits = len(token.split(".")[1]) if "." in token else 0
    return abs(value - float(token)) <= 0.5 * 10 ** (-digits) + 1e-9
