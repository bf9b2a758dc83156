"""Statistics of ``microscale compare`` on synthetic numbers with known answers.

Critical values are from a printed Student-t table (two-sided 95%: df 1 12.706, 2 4.303,
4 2.776, 5 2.571, 6 2.447, 9 2.262, 29 2.045), not from the code under test.
"""

import math

import pytest

from microscale.experiments import stats

T95 = {1: 12.706, 2: 4.303, 4: 2.776, 5: 2.571, 6: 2.447, 9: 2.262, 29: 2.045}


@pytest.mark.parametrize("df,t", sorted(T95.items()))
def test_t_quantile_matches_the_printed_table(df, t):
    assert stats.t_quantile(df) == pytest.approx(t, abs=1e-3)


@pytest.mark.parametrize(
    "values,mean,sd",
    [
        ([1.0, 2.0, 3.0], 2.0, 1.0),
        ([2.1, 1.9, 2.3, 1.7, 2.0], 2.0, math.sqrt(0.2 / 4)),
        ([0.5, -0.5], 0.0, math.sqrt(0.5)),
        ([3.0] * 10, 3.0, 0.0),
    ],
)
def test_mean_ci_known_values(values, mean, sd):
    n = len(values)
    ci = stats.mean_ci(values)
    h = T95[n - 1] * sd / math.sqrt(n)
    assert ci["n"] == n
    assert ci["mean"] == pytest.approx(mean)
    assert ci["sd"] == pytest.approx(sd, abs=1e-12)
    assert ci["half_width"] == pytest.approx(h, rel=1e-3, abs=1e-12)
    assert ci["ci95"] == pytest.approx([mean - h, mean + h], rel=1e-3, abs=1e-12)


def test_mean_ci_drops_missing_and_one_value_has_no_interval():
    ci = stats.mean_ci([1.5, None, float("nan")])
    assert ci == {"mean": 1.5, "sd": None, "n": 1, "ci95": None, "half_width": None}
    assert stats.mean_ci([])["mean"] is None


def test_paired_gaps_are_per_seed_relative_percent():
    x = {0: 1.01, 1: 2.0, 2: 3.3, 3: float("nan"), 4: 1.0}
    ref = {0: 1.0, 1: 2.0, 2: 3.0, 3: 1.0}  # seed 4 has no reference
    g = stats.paired_gaps(x, ref)
    assert g == pytest.approx({0: 1.0, 1: 0.0, 2: 10.0})


def test_eval_se_from_paired_batches():
    # d = [.1, .2, .3, .4]: sd = sqrt(0.05 / 3) = 0.12910, se = 0.06455 loss units,
    # reference mean 1.0 -> 6.455 points.
    se = stats.eval_se([1.1, 1.2, 1.3, 1.4], [1.0, 1.0, 1.0, 1.0])
    assert se == pytest.approx(100 * math.sqrt(0.05 / 3) / 2, rel=1e-9)
    # a constant shift has no eval noise at all
    assert stats.eval_se([2.5, 3.5, 4.5], [2.0, 3.0, 4.0]) == pytest.approx(0.0, abs=1e-12)
    assert stats.eval_se([1.0], [1.0]) is None
    with pytest.raises(ValueError, match="same batches"):
        stats.eval_se([1.0, 2.0], [1.0])


def test_combined_eval_se_of_a_mean_over_seeds():
    assert stats.combined_eval_se([0.3, 0.4]) == pytest.approx(0.25)
    assert stats.combined_eval_se([0.2, None]) is None


@pytest.mark.parametrize(
    "sd,h,n",
    [
        (0.5, 0.5, 7),  # t5 .5/sqrt6 = .525 > .5; t6 .5/sqrt7 = .462
        (0.1, 0.5, 3),  # n = 2: 12.706 * .1 / 1.414 = .898; n = 3: 4.303 * .1 / 1.732 = .248
        (1.0, 0.5, 18),  # t16 2.120/sqrt17 = .514; t17 2.110/sqrt18 = .497
    ],
)
def test_seeds_needed(sd, h, n):
    assert stats.seeds_needed(sd, h) == n
    assert stats.seeds_needed(None) is None


@pytest.mark.parametrize(
    "ci,words",
    [
        ({"mean": 2.1, "n": 4, "ci95": [1.6, 2.6]}, "is worse than `bf16` by 2.10%"),
        ({"mean": -1.5, "n": 3, "ci95": [-2.0, -1.0]}, "is better than `bf16` by 1.50%"),
        (
            {"mean": 0.05, "n": 5, "ci95": [-0.3, 0.4]},
            "no difference detected; a gap larger than 0.40% (worse) or 0.30% (better) is excluded",
        ),
        ({"mean": 0.7, "n": 1, "ci95": None}, "not a verdict"),
        ({"mean": None, "n": 0, "ci95": None}, "no gap"),
    ],
)
def test_verdict_words_follow_the_interval(ci, words):
    v = stats.verdict("nvfp4", "bf16", ci)
    assert words in v
    if ci["ci95"]:
        assert f"n = {ci['n']} seeds" in v


def test_loglinear_fit_known_line_and_interval():
    # log10 sizes 0, 1, 2 and gaps 0, 2, 1: slope 0.5, intercept 0.5, rss 1.5 on 1 df,
    # slope se = sqrt(1.5) / sqrt(2), 95% half-width 12.706 x that.
    fit = stats.loglinear_fit([1, 10, 100], [0.0, 2.0, 1.0])
    assert fit["slope"] == pytest.approx(0.5)
    assert fit["intercept"] == pytest.approx(0.5)
    h = 12.706 * math.sqrt(1.5) / math.sqrt(2)
    assert fit["slope_ci95"] == pytest.approx([0.5 - h, 0.5 + h], rel=1e-3)
    p = stats.predict(fit, 1000)
    assert p["gap"] == pytest.approx(2.0)
    se = math.sqrt(1.5) * math.sqrt(1 / 3 + 4 / 2)
    assert p["ci95"] == pytest.approx([2.0 - 12.706 * se, 2.0 + 12.706 * se], rel=1e-3)


def test_loglinear_fit_exact_trend_and_bad_input():
    sizes = [1e5, 1e5, 1e6, 1e6, 1e7, 1e7]
    gaps = [1 - 0.5 * math.log10(s) + 3 for s in sizes]
    fit = stats.loglinear_fit(sizes, gaps)
    assert fit["slope"] == pytest.approx(-0.5)
    assert fit["slope_ci95"] == pytest.approx([-0.5, -0.5], abs=1e-9)
    assert stats.predict(fit, 1.2e10)["gap"] == pytest.approx(4 - 0.5 * math.log10(1.2e10))
    with pytest.raises(ValueError, match="2 sizes"):
        stats.loglinear_fit([1e5, 1e5, 1e5], [1.0, 2.0, 3.0])
