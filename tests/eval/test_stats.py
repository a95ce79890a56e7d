"""Confidence intervals against hand-computed values."""

import math

import pytest

from shipyard.eval.stats import clustered_diff_ci, paired_diff_ci, wilson_ci


def test_wilson_matches_formula() -> None:
    lo, hi = wilson_ci(30, 100)
    assert lo == pytest.approx(0.2189, abs=1e-4) and hi == pytest.approx(0.3958, abs=1e-4)
    assert wilson_ci(0, 10)[0] == 0.0 and wilson_ci(0, 0) == (0.0, 1.0)


def test_paired_diff() -> None:
    before = [0.0] * 50 + [1.0] * 50
    after = [1.0] * 20 + [0.0] * 30 + [1.0] * 50
    mean, lo, hi = paired_diff_ci(before, after)
    sd = math.sqrt((20 * 0.8**2 + 80 * 0.2**2) / 99)
    assert mean == pytest.approx(0.2)
    assert lo == pytest.approx(0.2 - 1.96 * sd / 10) and hi == pytest.approx(0.2 + 1.96 * sd / 10)
    with pytest.raises(ValueError, match="equal"):
        paired_diff_ci([1.0], [1.0, 0.0])


def test_clustered_diff_is_the_paired_one_for_singletons_and_wider_for_correlated_samples() -> None:
    before = [0.0] * 50 + [1.0] * 50
    after = [1.0] * 20 + [0.0] * 30 + [1.0] * 50
    mean, lo, hi = clustered_diff_ci(before, after, list(range(100)))
    assert (mean, lo, hi) == pytest.approx(paired_diff_ci(before, after))
    # the same 100 differences as 50 prompts sampled twice, both samples alike: a cluster's two
    # residuals add, so the variance is 2 * 50/49 * 99/100 times the independent one (hand-computed)
    prompts = [i // 2 for i in range(100)]
    mean2, lo2, hi2 = clustered_diff_ci(before, after, prompts)
    assert mean2 == pytest.approx(0.2)
    ratio = (hi2 - lo2) / (hi - lo)
    assert ratio == pytest.approx(math.sqrt(2 * 50 / 49 * 99 / 100))
    with pytest.raises(ValueError, match="cluster labels"):
        clustered_diff_ci([1.0, 0.0], [1.0, 0.0], [0])
