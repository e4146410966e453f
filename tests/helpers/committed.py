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


def cells(line: str) -> list[str]:
    """A markdown table row's cells, stripped: ``| a | b |`` -> ``["a", "b"]``."""
    return [c.strip() for c in line.strip().strip("|").split("|")]


def tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """Every markdown table of ``text`` in order: its header and its rows of cells (the
    ``| --- |`` line left out)."""
    found, rows = [], []
    for line in [*text.split("\n"), ""]:
        if line.startswith("|"):
            rows.append(cells(line))
        elif rows:
            found.append((rows[0], rows[2:]))
            rows = []
    return found
