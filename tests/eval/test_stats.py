"""Confidence intervals against hand-computed values."""

import math

import pytest

from shipyard.eval.stats import paired_diff_ci, wilson_ci


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
