"""Evaluation statistics: exact McNemar (incl. the paper's numbers), Student-t intervals,
reproducible percentile bootstraps (item, paired, clustered) and stable seed offsets."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats as sp_stats

from certkv.errors import CertKVError
from certkv.eval.stats import (
    BOOTSTRAP_RESAMPLES,
    BOOTSTRAP_SEED,
    Interval,
    bootstrap_mean,
    clustered_bootstrap_delta,
    mcnemar,
    paired_bootstrap_delta,
    paired_perplexity_delta,
    seed_for,
    t_interval,
)


def paired_flags(both_pass: int, critical: int, reverse: int, both_fail: int):
    """Reference and method pass flags realising the given 2x2 table."""
    ref = [True] * both_pass + [True] * critical + [False] * reverse + [False] * both_fail
    met = [True] * both_pass + [False] * critical + [True] * reverse + [False] * both_fail
    return ref, met


# --------------------------------------------------------------------------------------------
# McNemar


def test_constants():
    assert BOOTSTRAP_SEED == 20260425
    assert BOOTSTRAP_RESAMPLES == 10_000


def test_mcnemar_table_counts():
    ref = [True, True, False, False, True, False, True]
    met = [True, False, True, False, False, False, True]
    result = mcnemar(ref, met)
    assert (result.both_pass, result.critical, result.reverse, result.both_fail) == (2, 2, 1, 2)
    assert result.n == 7
    assert result.discordant == 3


def test_mcnemar_hand_computed():
    # 1 vs 0 discordant: p = 2 * C(1,0) / 2 = 1
    assert mcnemar(*paired_flags(3, 1, 0, 2)).p_value == 1.0
    # 3 vs 0: p = 2 / 8 = 0.25
    assert mcnemar(*paired_flags(0, 3, 0, 0)).p_value == 0.25
    # 4 vs 1: p = 2 * (1 + 5) / 32 = 0.375
    assert mcnemar(*paired_flags(10, 4, 1, 10)).p_value == 0.375
    # order of critical/reverse does not matter (two-sided)
    assert mcnemar(*paired_flags(10, 1, 4, 10)).p_value == 0.375


def test_mcnemar_paper_numbers():
    assert mcnemar(*paired_flags(50, 16, 16, 18)).p_value == 1.0
    five_three = mcnemar(*paired_flags(80, 5, 3, 12)).p_value
    assert five_three == 0.7265625  # 2 * (1 + 8 + 28 + 56) / 256
    assert f"{five_three:.3f}" == "0.727"
    assert mcnemar(*paired_flags(0, 31, 0, 0)).p_value < 1e-9
    assert mcnemar(*paired_flags(0, 0, 31, 0)).p_value == pytest.approx(2.0**-30, rel=1e-12)


def test_mcnemar_no_discordant_pairs():
    result = mcnemar(*paired_flags(7, 0, 0, 3))
    assert result.p_value == 1.0
    assert result.discordant == 0


@pytest.mark.parametrize(
    ("critical", "reverse"),
    [(0, 1), (2, 7), (9, 9), (12, 5), (40, 25), (0, 60), (150, 120), (3, 300)],
)
def test_mcnemar_matches_scipy_binomtest(critical, reverse):
    result = mcnemar(*paired_flags(11, critical, reverse, 4))
    expected = sp_stats.binomtest(critical, critical + reverse, p=0.5,
                                  alternative="two-sided").pvalue
    assert result.p_value == pytest.approx(expected, rel=1e-9, abs=1e-300)


def test_mcnemar_accepts_numpy_and_01():
    ref = np.array([1, 1, 0, 0])
    met = np.array([True, False, True, False])
    result = mcnemar(ref, met)
    assert (result.both_pass, result.critical, result.reverse, result.both_fail) == (1, 1, 1, 1)


def test_mcnemar_errors():
    with pytest.raises(CertKVError, match="empty"):
        mcnemar([], [])
    with pytest.raises(CertKVError, match="different lengths"):
        mcnemar([True, False], [True])
    with pytest.raises(CertKVError, match="True/False"):
        mcnemar([0.5, 1.0], [True, False])
    with pytest.raises(CertKVError, match="True/False"):
        mcnemar(["yes", "no"], [True, False])


# --------------------------------------------------------------------------------------------
# Student t


def test_t_interval_by_hand():
    values = [0.12, -0.05, 0.31, 0.08, 0.22, 0.01, 0.17]
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = sp_stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    result = t_interval(values)
    assert result.method == "t"
    assert result.n == n
    assert result.estimate == pytest.approx(mean, rel=1e-12)
    assert result.low == pytest.approx(mean - half, rel=1e-12)
    assert result.high == pytest.approx(mean + half, rel=1e-12)
    low, high = sp_stats.t.interval(0.95, n - 1, loc=mean, scale=sp_stats.sem(values))
    assert (result.low, result.high) == pytest.approx((low, high), rel=1e-12)


def test_t_interval_level_and_constant():
    values = [1.0, 2.0, 4.0, 3.5]
    wide, narrow = t_interval(values, 0.99), t_interval(values, 0.80)
    assert wide.low < narrow.low < narrow.high < wide.high
    flat = t_interval([0.1] * 5)
    assert flat.low == flat.high == flat.estimate == 0.1


def test_t_interval_single_value():
    result = t_interval([2.5])
    assert result == Interval(2.5, -math.inf, math.inf, 1, "t")


def test_t_interval_errors():
    with pytest.raises(CertKVError, match="empty"):
        t_interval([])
    with pytest.raises(CertKVError, match="NaN or Inf"):
        t_interval([1.0, float("nan")])
    with pytest.raises(CertKVError, match="confidence level"):
        t_interval([1.0, 2.0], level=95)


# --------------------------------------------------------------------------------------------
# Bootstrap


def sample(n: int = 120, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(loc=1.0, scale=2.0, size=n)


def test_bootstrap_reproducible_and_seed_dependent():
    values = sample()
    first = bootstrap_mean(values)
    assert first == bootstrap_mean(list(values))
    assert first.method == "bootstrap"
    assert first.n == len(values)
    assert first.estimate == pytest.approx(values.mean())
    assert first.low < first.estimate < first.high
    other = bootstrap_mean(values, seed=BOOTSTRAP_SEED + 1)
    assert (other.low, other.high) != (first.low, first.high)
    assert other.estimate == first.estimate


def test_bootstrap_matches_manual_percentiles():
    values = sample(40, seed=3)
    result = bootstrap_mean(values, seed=7, resamples=500, level=0.9)
    idx = np.random.default_rng(7).integers(0, 40, size=(500, 40))
    means = values[idx].sum(axis=1) / 40
    assert (result.low, result.high) == pytest.approx(tuple(np.quantile(means, [0.05, 0.95])))


def test_bootstrap_width_tracks_standard_error():
    values = sample(400, seed=1)
    result = bootstrap_mean(values)
    se = values.std(ddof=1) / math.sqrt(len(values))
    assert (result.high - result.low) == pytest.approx(2 * 1.96 * se, rel=0.1)


def test_bootstrap_covers_true_mean():
    covered = 0
    for trial in range(100):
        result = bootstrap_mean(sample(60, seed=100 + trial), seed=trial, resamples=1000)
        covered += result.low <= 1.0 <= result.high
    assert 85 <= covered <= 100


def test_bootstrap_degenerate_cases():
    flat = bootstrap_mean([0.3] * 50)
    assert flat.low == flat.high == flat.estimate == 0.3
    single = bootstrap_mean([4.0])  # one sample: no interval, not a zero-width one
    assert single == Interval(4.0, -math.inf, math.inf, 1, "bootstrap")
    one_slice = clustered_bootstrap_delta([0.0, 1.0], [1.0, 1.0], ["a", "a"])
    assert (one_slice.estimate, one_slice.low, one_slice.high) == (0.5, -math.inf, math.inf)


def test_bootstrap_pass_rate_within_unit_interval():
    flags = [True] * 70 + [False] * 30
    result = bootstrap_mean(flags)
    assert result.estimate == pytest.approx(0.7)
    assert 0.0 <= result.low < 0.7 < result.high <= 1.0


def test_bootstrap_errors():
    with pytest.raises(CertKVError, match="empty"):
        bootstrap_mean([])
    with pytest.raises(CertKVError, match="NaN or Inf"):
        bootstrap_mean([1.0, math.inf])
    with pytest.raises(CertKVError, match="one-dimensional"):
        bootstrap_mean([[1.0, 2.0], [3.0, 4.0]])
    with pytest.raises(CertKVError, match="resamples"):
        bootstrap_mean([1.0, 2.0], resamples=0)
    with pytest.raises(CertKVError, match="seed"):
        bootstrap_mean([1.0, 2.0], seed=-1)
    with pytest.raises(CertKVError, match="confidence level"):
        bootstrap_mean([1.0, 2.0], level=1.0)


def test_paired_constant_shift_is_zero_width_unpaired_is_not():
    reference = np.random.default_rng(2).integers(0, 100, size=80).astype(float)
    method = reference + 0.5
    paired = paired_bootstrap_delta(reference, method)
    assert paired == Interval(0.5, 0.5, 0.5, 80, "bootstrap")
    # resampling reference and method independently ignores the pairing: wide interval
    ref_ci = bootstrap_mean(reference, seed=seed_for("ref"))
    met_ci = bootstrap_mean(method, seed=seed_for("met"))
    assert ref_ci.high - ref_ci.low > 5.0
    assert met_ci.high - met_ci.low > 5.0


def test_paired_equals_bootstrap_of_differences():
    reference, method = sample(90, seed=4), sample(90, seed=5)
    paired = paired_bootstrap_delta(reference, method, seed=11, resamples=2000)
    direct = bootstrap_mean(method - reference, seed=11, resamples=2000)
    assert paired == direct
    assert paired.estimate == pytest.approx(method.mean() - reference.mean())


def test_paired_errors():
    with pytest.raises(CertKVError, match="different lengths"):
        paired_bootstrap_delta([1.0, 2.0], [1.0])
    with pytest.raises(CertKVError, match="empty"):
        paired_bootstrap_delta([], [])


def ruler_like(slices: int = 30, subtasks: int = 7, seed: int = 6):
    """Per-slice shared effect, identical for every subtask sample of a slice."""
    rng = np.random.default_rng(seed)
    effect = rng.normal(0.0, 1.0, size=slices)
    reference = rng.uniform(0.0, 1.0, size=slices * subtasks)
    method = reference + np.repeat(effect, subtasks)
    clusters = np.repeat(np.arange(slices), subtasks)
    return reference, method, clusters


def test_clustered_wider_than_item_level():
    reference, method, clusters = ruler_like()
    clustered = clustered_bootstrap_delta(reference, method, clusters)
    items = paired_bootstrap_delta(reference, method)
    assert clustered.n == 30
    assert items.n == 210
    assert clustered.estimate == pytest.approx(items.estimate)
    # 30 independent slices, not 210 independent items: about sqrt(7) wider
    ratio = (clustered.high - clustered.low) / (items.high - items.low)
    assert 2.0 < ratio < 3.5


def test_clustered_keeps_clusters_intact():
    # every resample is a mean of whole-slice means, each from {-1, +1}: with 4 slices of
    # 7 samples the replicate means lie on the grid k/2 - 1, never between
    reference = np.zeros(28)
    method = np.repeat([-1.0, 1.0, 1.0, -1.0], 7) + np.tile(np.linspace(-0.1, 0.1, 7), 4)
    clusters = np.repeat(["a", "b", "c", "d"], 7)
    result = clustered_bootstrap_delta(reference, method, clusters, resamples=2000, level=0.5)
    for bound in (result.low, result.high):
        assert bound * 2 == pytest.approx(round(bound * 2), abs=1e-12)


def test_clustered_singletons_equal_paired_and_is_reproducible():
    reference, method = sample(50, seed=8), sample(50, seed=9)
    singletons = clustered_bootstrap_delta(reference, method, range(50), seed=3, resamples=1500)
    assert singletons == paired_bootstrap_delta(reference, method, seed=3, resamples=1500)
    reference, method, clusters = ruler_like()
    seed = seed_for("ruler", 8192)
    assert clustered_bootstrap_delta(reference, method, clusters, seed=seed) == \
        clustered_bootstrap_delta(reference, method, list(clusters), seed=seed)


def test_clustered_unequal_sizes_pools_items():
    reference = [0.0] * 5
    method = [1.0, 1.0, 1.0, 0.0, 4.0]
    result = clustered_bootstrap_delta(reference, method, ["x", "x", "x", "y", "z"])
    assert result.estimate == pytest.approx(7.0 / 5)
    assert result.n == 3
    assert 0.0 <= result.low <= result.high <= 4.0


def test_clustered_degenerate_and_errors():
    one = clustered_bootstrap_delta([1.0, 2.0, 3.0], [2.0, 2.0, 5.0], [0, 0, 0])
    assert one == Interval(1.0, -math.inf, math.inf, 1, "bootstrap")  # one slice: no interval
    with pytest.raises(CertKVError, match="one cluster label per item"):
        clustered_bootstrap_delta([1.0, 2.0], [1.0, 3.0], [0])
    with pytest.raises(CertKVError, match="hashable"):
        clustered_bootstrap_delta([1.0, 2.0], [1.0, 3.0], [[0], [1]])
    with pytest.raises(CertKVError, match="different lengths"):
        clustered_bootstrap_delta([1.0, 2.0], [1.0], [0, 1])


# --------------------------------------------------------------------------------------------
# Seeds


def test_seed_for_stable_value():
    # sha256(b'["ruler",8192,"cwe"]').hexdigest()[:8] == "cf6f5c83" == 3480181891,
    # so the formula gives 20260425 + 3480181891 == 3500442316 on every run and machine.
    assert seed_for("ruler", 8192, "cwe") == 3500442316


def test_seed_for_differs_across_parts():
    seeds = {
        seed_for("ruler", 8192, "cwe"),
        seed_for("ruler", 8192, "vt"),
        seed_for("ruler", 4096, "cwe"),
        seed_for("ruler", "8192", "cwe"),
        seed_for("cwe", 8192, "ruler"),
        seed_for("niah"),
    }
    assert len(seeds) == 6
    assert seed_for() == BOOTSTRAP_SEED
    assert seed_for("niah", base=0) == seed_for("niah") - BOOTSTRAP_SEED
    assert all(isinstance(s, int) and s >= 0 for s in seeds)


def test_seed_for_errors():
    with pytest.raises(CertKVError, match="JSON"):
        seed_for(object())
    with pytest.raises(CertKVError, match="JSON"):
        seed_for(float("nan"))
    with pytest.raises(CertKVError, match="base"):
        seed_for("x", base=-5)


def windows(ppls, tokens=64):
    return [(tokens * math.log(p), tokens) for p in ppls]


def test_pooled_perplexity_delta_is_the_difference_of_the_pooled_values():
    ref = [(120.0, 64), (300.0, 128), (80.0, 32)]
    mine = [(121.0, 64), (299.0, 128), (86.0, 32)]
    iv = paired_perplexity_delta(ref, mine)
    pooled = math.exp(506.0 / 224) - math.exp(500.0 / 224)
    assert iv.estimate == pytest.approx(pooled, rel=1e-12) and iv.n == 3 and iv.method == "t"
    assert iv.low < iv.estimate < iv.high
    # not the mean of the per-window perplexity differences, which differs here
    per_window = np.mean([math.exp(m / t) - math.exp(r / t)
                          for (r, t), (m, _) in zip(ref, mine, strict=True)])
    assert abs(per_window - iv.estimate) > 1e-3


def test_pooled_perplexity_interval_is_a_t_interval_of_per_token_nll_mapped_to_perplexity():
    rng = np.random.default_rng(0)
    ref = windows(rng.uniform(20, 40, 12))
    mine = windows(np.array([math.exp(r / t) for r, t in ref]) + rng.normal(0.3, 0.5, 12))
    iv = paired_perplexity_delta(ref, mine)
    d = np.array([(m - r) / t for (r, t), (m, _) in zip(ref, mine, strict=True)])
    t = t_interval(d)  # equal windows: the plain t-interval of the per-token differences
    base = math.exp(sum(r for r, _ in ref) / sum(n for _, n in ref))
    expected = (base * math.expm1(t.estimate), base * math.expm1(t.low), base * math.expm1(t.high))
    assert (iv.estimate, iv.low, iv.high) == pytest.approx(expected, rel=1e-9)


def test_pooled_perplexity_of_one_window_has_no_interval_and_bad_input_is_refused():
    iv = paired_perplexity_delta(windows([10.0]), windows([10.5]))
    assert iv.estimate == pytest.approx(0.5) and (iv.low, iv.high) == (-math.inf, math.inf)
    with pytest.raises(CertKVError, match="same non-empty windows"):
        paired_perplexity_delta(windows([10.0, 11.0]), windows([10.5]))
    with pytest.raises(CertKVError, match="at least one token"):
        paired_perplexity_delta([(1.0, 0)], [(1.0, 0)])
