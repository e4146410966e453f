"""Paired evaluation statistics of the paper (8-9): McNemar, bootstrap and t intervals.

Every method runs on the same prompts as the dense reference, so comparisons are paired:

* :func:`mcnemar` -- exact two-sided McNemar test on paired pass/fail, with the 2x2 table
  ("critical" = dense passes, method fails; "reverse" = dense fails, method passes).
* :func:`bootstrap_mean`, :func:`paired_bootstrap_delta`, :func:`clustered_bootstrap_delta` --
  percentile bootstrap CIs (Efron & Tibshirani 1993, ch. 13) with 10,000 resamples and seed
  20260425; grouped analyses offset the seed with :func:`seed_for`.
* :func:`t_interval` -- Student-t CI of a mean; :func:`paired_perplexity_delta` -- Student-t CI
  of the difference of two perplexities pooled over paired windows (exp of total NLL over total
  tokens), the estimate exactly the difference of the pooled values.

One sample gives no interval: every function returns ``[-inf, inf]`` for it (a report prints
"no CI"), never a zero-width interval that would read as certainty.

All functions take plain sequences (lists, tuples, numpy arrays) and return frozen dataclasses.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
from scipy import stats as sp_stats

from certkv.errors import CertKVError

BOOTSTRAP_SEED = 20260425
BOOTSTRAP_RESAMPLES = 10_000

# Resample matrices are built in row chunks of at most this many entries (bounded memory).
_CHUNK_ENTRIES = 1 << 22


# --------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class McNemar:
    """Paired 2x2 table of reference vs method pass/fail and the exact McNemar p-value."""

    both_pass: int
    critical: int  # reference passes, method fails
    reverse: int  # reference fails, method passes
    both_fail: int
    p_value: float  # exact two-sided; 1.0 when there are no discordant pairs

    @property
    def n(self) -> int:
        """Number of paired items."""
        return self.both_pass + self.critical + self.reverse + self.both_fail

    @property
    def discordant(self) -> int:
        """Number of pairs where exactly one of reference and method passes."""
        return self.critical + self.reverse


@dataclass(frozen=True)
class Interval:
    """A point estimate with a two-sided confidence interval.

    ``n`` is the number of independent units: values for ``"t"`` and the item-level bootstrap,
    clusters for :func:`clustered_bootstrap_delta`. ``method`` is ``"bootstrap"`` or ``"t"``.
    """

    estimate: float
    low: float
    high: float
    n: int
    method: str

    @property
    def bounded(self) -> bool:
        """Whether there is an interval at all (one sample gives ``[-inf, inf]``: none)."""
        return math.isfinite(self.low) and math.isfinite(self.high)


# --------------------------------------------------------------------------------------------
# Input checks


def _as_values(values: Sequence[float], name: str) -> np.ndarray:
    """``values`` as a non-empty, finite, 1-D float64 array; CertKVError otherwise."""
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise CertKVError(f"{name} must be a sequence of numbers; pass a flat list of "
                          "floats.") from exc
    if arr.ndim != 1:
        raise CertKVError(f"{name} must be one-dimensional (got shape {arr.shape}); pass a "
                          "flat list with one number per item.")
    if arr.size == 0:
        raise CertKVError(f"{name} is empty; pass at least one value per evaluated item.")
    if not np.all(np.isfinite(arr)):
        raise CertKVError(f"{name} holds NaN or Inf; drop or fix the non-finite items first.")
    return arr


def _as_pass_fail(values: Sequence[bool], name: str) -> np.ndarray:
    """``values`` as a non-empty 1-D bool array; entries must be bools or 0/1."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise CertKVError(f"{name} must be one-dimensional (got shape {arr.shape}); pass one "
                          "pass/fail flag per item.")
    if arr.size == 0:
        raise CertKVError(f"{name} is empty; pass one pass/fail flag per evaluated item.")
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iuf" or not np.all((arr == 0) | (arr == 1)):
            raise CertKVError(f"{name} must hold only True/False (or 1/0); convert the scores "
                              "to pass/fail flags first.")
        arr = arr.astype(bool)
    return arr


def _same_length(a: np.ndarray, b: np.ndarray, names: str) -> None:
    """CertKVError unless the paired arrays ``a`` and ``b`` have the same length."""
    if a.shape[0] != b.shape[0]:
        raise CertKVError(f"{names} have different lengths ({a.shape[0]} vs {b.shape[0]}); "
                          "pass paired results of the same items in the same order.")


def _check_level(level: float) -> None:
    if not 0.0 < level < 1.0:
        raise CertKVError(f"level={level!r} is not a confidence level; pass a value strictly "
                          "between 0 and 1, e.g. 0.95.")


def _check_bootstrap_args(seed: int, resamples: int, level: float) -> None:
    _check_level(level)
    if isinstance(resamples, bool) or not isinstance(resamples, int | np.integer) \
            or resamples < 1:
        raise CertKVError(f"resamples={resamples!r} is invalid; pass a positive integer such "
                          f"as {BOOTSTRAP_RESAMPLES}.")
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or seed < 0:
        raise CertKVError(f"seed={seed!r} is invalid; pass a non-negative integer such as "
                          "seed_for(...).")


# --------------------------------------------------------------------------------------------
# McNemar


def _exact_mcnemar_p(critical: int, reverse: int) -> float:
    """Exact two-sided McNemar p-value (McNemar 1947; exact form: binomial test, p=0.5).

    With ``n = critical + reverse`` discordant pairs and ``k = min(critical, reverse)``:
    ``p = min(1, 2 * sum_{i=0..k} C(n, i) / 2**n)``; ``p = 1`` when ``n = 0``. Computed in exact
    rational arithmetic, so it equals ``scipy.stats.binomtest(k, n, 0.5).pvalue``.
    """
    n = critical + reverse
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(min(critical, reverse) + 1))
    return float(min(Fraction(1), Fraction(2 * tail, 2**n)))


def mcnemar(reference_pass: Sequence[bool], method_pass: Sequence[bool]) -> McNemar:
    """Exact McNemar test of paired pass/fail results (McNemar 1947, exact binomial form).

    Inputs: one pass/fail flag per item for the reference (dense) and the method, same items in
    the same order. Output: the 2x2 table (``critical`` = reference passes and method fails,
    ``reverse`` = reference fails and method passes) and the exact two-sided p-value of the
    binomial test of ``critical`` vs ``reverse`` at p=0.5 (1.0 when there are no discordant
    pairs).
    """
    ref = _as_pass_fail(reference_pass, "reference_pass")
    met = _as_pass_fail(method_pass, "method_pass")
    _same_length(ref, met, "reference_pass and method_pass")
    critical = int(np.sum(ref & ~met))
    reverse = int(np.sum(~ref & met))
    return McNemar(
        both_pass=int(np.sum(ref & met)),
        critical=critical,
        reverse=reverse,
        both_fail=int(np.sum(~ref & ~met)),
        p_value=_exact_mcnemar_p(critical, reverse),
    )


# --------------------------------------------------------------------------------------------
# Bootstrap


def _resampled_means(sums: np.ndarray, sizes: np.ndarray, rng: np.random.Generator,
                     resamples: int) -> np.ndarray:
    """Bootstrap replicates of a pooled mean, resampling whole units with replacement.

    Unit ``g`` contributes the sum ``sums[g]`` over its ``sizes[g]`` items. Each replicate draws
    ``G = len(sums)`` unit indices uniformly with replacement and returns
    ``sum(sums[idx]) / sum(sizes[idx])``. Vectorised in row chunks of bounded size.
    """
    units = sums.shape[0]
    rows = max(1, _CHUNK_ENTRIES // units)
    out = np.empty(resamples, dtype=np.float64)
    for start in range(0, resamples, rows):
        stop = min(resamples, start + rows)
        idx = rng.integers(0, units, size=(stop - start, units))
        out[start:stop] = sums[idx].sum(axis=1) / sizes[idx].sum(axis=1)
    return out


def _percentile_bootstrap(values: np.ndarray, codes: np.ndarray, units: int, *, seed: int,
                          resamples: int, level: float) -> Interval:
    """Percentile bootstrap CI of the mean of ``values``, resampling the units in ``codes``.

    ``codes[i]`` in ``0..units-1`` names the unit of item ``i``. The interval is the
    ``(1-level)/2`` and ``(1+level)/2`` quantiles (numpy's linear interpolation) of the
    replicate means (Efron & Tibshirani 1993, percentile method). A constant sample gives the
    degenerate interval ``[mean, mean]``; a single unit gives none (``[-inf, inf]``).
    """
    if units == 1:  # one unit: every replicate is the sample itself, which says nothing
        return Interval(float(values.mean()), -math.inf, math.inf, units, "bootstrap")
    if np.ptp(values) == 0:  # exact: no rounding of the mean of identical values
        value = float(values[0])
        return Interval(value, value, value, units, "bootstrap")
    estimate = float(values.mean())
    sums = np.bincount(codes, weights=values, minlength=units)
    sizes = np.bincount(codes, minlength=units).astype(np.float64)
    means = _resampled_means(sums, sizes, np.random.default_rng(seed), resamples)
    alpha = 1.0 - level
    low, high = np.quantile(means, [alpha / 2, 1.0 - alpha / 2])
    return Interval(estimate, float(low), float(high), units, "bootstrap")


def bootstrap_mean(values: Sequence[float], *, seed: int = BOOTSTRAP_SEED,
                   resamples: int = BOOTSTRAP_RESAMPLES, level: float = 0.95) -> Interval:
    """Percentile bootstrap CI of the mean (resampling items with replacement).

    Inputs: one value per item (e.g. 0/1 pass flags or scores); ``seed`` for
    ``numpy.random.default_rng``; ``resamples`` replicates; ``level`` the coverage. Output:
    ``Interval(estimate=mean, low, high, n=len(values), method="bootstrap")``, the
    ``(1-level)/2`` and ``(1+level)/2`` percentiles of the replicate means (Efron & Tibshirani
    1993, ch. 13). Exactly reproducible for a given seed; n=1 or constant values give a
    zero-width interval.
    """
    _check_bootstrap_args(seed, resamples, level)
    arr = _as_values(values, "values")
    codes = np.arange(arr.shape[0])
    return _percentile_bootstrap(arr, codes, arr.shape[0], seed=seed, resamples=resamples,
                                 level=level)


def _paired_deltas(reference: Sequence[float], method: Sequence[float]) -> np.ndarray:
    """Per-item ``method - reference`` after validating both sequences and their pairing."""
    ref = _as_values(reference, "reference")
    met = _as_values(method, "method")
    _same_length(ref, met, "reference and method")
    return met - ref


def paired_bootstrap_delta(reference: Sequence[float], method: Sequence[float], *,
                           seed: int = BOOTSTRAP_SEED, resamples: int = BOOTSTRAP_RESAMPLES,
                           level: float = 0.95) -> Interval:
    """CI of mean(method - reference) resampling the PAIRS (same indices for both).

    Inputs: per-item reference (dense) and method values for the same items in the same order.
    Resampling pairs is resampling the per-item differences ``d_i = method_i - reference_i``, so
    the result is the percentile bootstrap of ``mean(d)`` (Efron & Tibshirani 1993, ch. 13);
    it equals :func:`bootstrap_mean` of the differences with the same seed. Output:
    ``Interval(estimate=mean(d), low, high, n=number of pairs, method="bootstrap")``.
    """
    _check_bootstrap_args(seed, resamples, level)
    deltas = _paired_deltas(reference, method)
    codes = np.arange(deltas.shape[0])
    return _percentile_bootstrap(deltas, codes, deltas.shape[0], seed=seed,
                                 resamples=resamples, level=level)


def paired_perplexity_delta(reference: Sequence[tuple[float, float]],
                            method: Sequence[tuple[float, float]],
                            level: float = 0.95) -> Interval:
    """CI of ``ppl(method) - ppl(reference)`` for perplexities pooled over paired windows.

    Inputs: per window, ``(nll, tokens)`` of the reference (dense) and of the method, the same
    windows in the same order. A pooled perplexity is ``exp(sum nll / sum tokens)`` (what a
    perplexity table prints as the value), and ``ppl(method) = ppl(reference) * exp(x)`` exactly,
    with ``x = sum(nll_m - nll_r) / sum(tokens)`` the token-weighted mean of the windows'
    per-token NLL differences ``d_i``. The interval is Student's t on ``x`` (``n - 1`` degrees
    of freedom; standard error of the weighted mean, ``sqrt(n / (n - 1) sum w_i^2 (d_i - x)^2)``
    with ``w_i`` the windows' token shares: ``s / sqrt(n)`` for equal windows), mapped through
    ``ppl(reference) * (exp(.) - 1)``, which is monotone: the reference's windows are the paired
    design's fixed prompts. The estimate is exactly the difference of the two printed values;
    one window gives no interval (``[-inf, inf]``). A t-interval, not a bootstrap: with the few
    windows a CPU affords (3), a percentile bootstrap has ten distinct resamples and claims far
    more than it knows. Output: ``Interval(estimate, low, high, n=windows, method="t")``.
    """
    _check_level(level)
    ref, mine = (np.asarray(x, dtype=np.float64).reshape(-1, 2) for x in (reference, method))
    if ref.shape != mine.shape or ref.shape[0] == 0:
        raise CertKVError(f"reference and method hold {ref.shape[0]} and {mine.shape[0]} "
                          "windows; pass the same non-empty windows for both.")
    if (ref[:, 1] <= 0).any() or (ref[:, 1] != mine[:, 1]).any():
        raise CertKVError("every window must count at least one token, the same for both "
                          "methods; pair the windows the two scored.")
    n, tokens = ref.shape[0], ref[:, 1]
    base = math.exp(ref[:, 0].sum() / tokens.sum())
    per_token = (mine[:, 0] - ref[:, 0]) / tokens  # d_i
    weights = tokens / tokens.sum()
    x = float((weights * per_token).sum())
    estimate = base * math.expm1(x)
    if n == 1:
        return Interval(estimate, -math.inf, math.inf, 1, "t")
    sem = math.sqrt(n / (n - 1) * float((weights**2 * (per_token - x) ** 2).sum()))
    half = float(sp_stats.t.ppf((1.0 + level) / 2.0, n - 1)) * sem
    return Interval(estimate, base * math.expm1(x - half), base * math.expm1(x + half), n, "t")


def _cluster_codes(clusters: Sequence[Hashable]) -> tuple[np.ndarray, int]:
    """Integer codes of cluster labels in order of first appearance, and the cluster count."""
    index: dict[Hashable, int] = {}
    try:
        codes = [index.setdefault(label, len(index)) for label in clusters]
    except TypeError as exc:
        raise CertKVError("clusters must hold hashable labels; pass e.g. one slice id (int or "
                          "str) per item.") from exc
    return np.asarray(codes, dtype=np.int64), len(index)


def clustered_bootstrap_delta(reference: Sequence[float], method: Sequence[float],
                              clusters: Sequence[Hashable], *, seed: int = BOOTSTRAP_SEED,
                              resamples: int = BOOTSTRAP_RESAMPLES,
                              level: float = 0.95) -> Interval:
    """Paired delta of the mean with whole clusters resampled (e.g. RULER slices: every subtask
    sample of a resampled slice comes along).

    Inputs: per-item reference and method values and one cluster label per item (e.g. the
    RULER slice id). Each replicate draws ``G`` clusters with replacement and takes the pooled
    mean of ``d_i = method_i - reference_i`` over all their items (sum of cluster sums / sum of
    cluster sizes; with equal-size clusters, the mean of cluster means) -- the cluster
    bootstrap (Davison & Hinkley 1997, 3.8), reported as a percentile interval. Output:
    ``Interval(estimate=mean(d), low, high, n=G clusters, method="bootstrap")``. With singleton
    clusters it equals :func:`paired_bootstrap_delta` for the same seed.
    """
    _check_bootstrap_args(seed, resamples, level)
    deltas = _paired_deltas(reference, method)
    codes, units = _cluster_codes(clusters)
    if codes.shape[0] != deltas.shape[0]:
        raise CertKVError(f"clusters has {codes.shape[0]} labels for {deltas.shape[0]} pairs; "
                          "pass exactly one cluster label per item.")
    return _percentile_bootstrap(deltas, codes, units, seed=seed, resamples=resamples,
                                 level=level)


# --------------------------------------------------------------------------------------------
# Student t


def t_interval(values: Sequence[float], level: float = 0.95) -> Interval:
    """Student-t CI of the mean (scipy.stats.t quantile; n=1 -> infinite half-width, not an error).

    Input: one value per item (e.g. per-window delta perplexity, method minus dense). Output:
    ``mean +- t_{(1+level)/2, n-1} * s / sqrt(n)`` with ``s`` the sample standard deviation
    (ddof=1) (Student 1908); ``method="t"``. Constant values give a zero-width interval; a
    single value gives ``[-inf, inf]``.
    """
    _check_level(level)
    arr = _as_values(values, "values")
    n = arr.shape[0]
    if n == 1:
        return Interval(float(arr[0]), -math.inf, math.inf, 1, "t")
    if np.ptp(arr) == 0:  # exact: no rounding of the mean of identical values
        value = float(arr[0])
        return Interval(value, value, value, n, "t")
    estimate = float(arr.mean())
    sem = float(arr.std(ddof=1)) / math.sqrt(n)
    half = float(sp_stats.t.ppf((1.0 + level) / 2.0, n - 1)) * sem
    return Interval(estimate, estimate - half, estimate + half, n, "t")


# --------------------------------------------------------------------------------------------
# Seeds


def seed_for(*parts: object, base: int = BOOTSTRAP_SEED) -> int:
    """A deterministic seed offset for grouped analyses (e.g. seed_for("ruler", 8192, "cwe")).

    Formula: ``base + int(sha256(json.dumps(list(parts), separators=(",", ":"),
    sort_keys=True).encode()).hexdigest()[:8], 16)``, i.e. base plus the first 32 bits of the
    SHA-256 of the parts' compact JSON (so ``"8192"`` and ``8192`` differ). With no parts it
    returns ``base`` itself. Stable across runs and machines (no use of Python's ``hash()``).
    Parts must be JSON values: str, int, float, bool, None, or lists/dicts of them.
    """
    if isinstance(base, bool) or not isinstance(base, int) or base < 0:
        raise CertKVError(f"base={base!r} is invalid; pass a non-negative integer seed such as "
                          "BOOTSTRAP_SEED.")
    if not parts:
        return base
    try:
        text = json.dumps(list(parts), separators=(",", ":"), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise CertKVError(f"seed_for parts {parts!r} are not plain JSON values; pass strings, "
                          "integers or finite floats.") from exc
    return base + int(hashlib.sha256(text.encode("utf-8")).hexdigest()[:8], 16)
