"""training.eval.stats: pass@k against hand computation, the mean's normal-approximation interval."""

import math

import pytest

from training.eval.stats import mean_pass_at_k, mean_with_interval, pass_at_k


def test_pass_at_k_matches_hand_computation():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    # pass@1 is the pass fraction c/n
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)
    # fewer failures than k: every k-subset holds a pass
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0


def test_mean_pass_at_k_averages_prompts():
    assert mean_pass_at_k([(5, 2), (5, 0)], 2) == pytest.approx((0.7 + 0.0) / 2)


@pytest.mark.parametrize("n, c, k, field", [(4, 1, 5, "k"), (4, 1, 0, "k"), (4, 5, 1, "c")])
def test_pass_at_k_bad_input_names_the_field(n, c, k, field):
    with pytest.raises(ValueError, match=rf"^{field}:"):
        pass_at_k(n, c, k)


def test_mean_interval_is_normal_approximation():
    values = [0.0, 1.0, 1.0, 0.0]
    got = mean_with_interval(values)
    half = 1.959963984540054 * math.sqrt(1 / 3) / 2  # z_0.975 * sample stdev / sqrt(4)
    assert got.mean == pytest.approx(0.5)
    assert got.low == pytest.approx(0.5 - half)
    assert got.high == pytest.approx(0.5 + half)
    assert mean_with_interval([0.3]).low == mean_with_interval([0.3]).high == pytest.approx(0.3)
