"""Group advantages: values by hand, zero-variance groups, Dr. GRPO mode, bad groups."""

import math

import pytest

from training.utils.rl.advantages import group_advantages


def test_group_advantages_standardise_with_unbiased_std():
    # mean 0.25; unbiased var = (0.75^2 + 3 * 0.25^2) / 3 = 0.25 -> std 0.5
    adv = group_advantages([1.0, 0.0, 0.0, 0.0])
    expected = [0.75 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4), -0.25 / (0.5 + 1e-4)]
    assert adv == pytest.approx(expected, rel=1e-12)
    assert math.fsum(adv) == pytest.approx(0.0, abs=1e-12)


def test_group_advantages_two_samples():
    # [3, 1]: mean 2, unbiased std sqrt(2) -> +-1/(sqrt(2) + 1e-4)
    adv = group_advantages([3.0, 1.0])
    assert adv == pytest.approx([1 / (math.sqrt(2) + 1e-4), -1 / (math.sqrt(2) + 1e-4)], rel=1e-7)


def test_zero_variance_group_gets_exactly_zero():
    assert group_advantages([0.1, 0.1, 0.1]) == [0.0, 0.0, 0.0]
    assert group_advantages([1, 1]) == [0.0, 0.0]
    assert group_advantages([0.1, 0.1, 0.1], scale_by_std=False) == [0.0, 0.0, 0.0]


def test_mean_centring_only_when_std_scaling_off():
    adv = group_advantages([1.0, 0.0, 0.0, 0.0], scale_by_std=False)
    assert adv == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-12)
    # the scale of the rewards survives (unlike the standardised form)
    assert group_advantages([10.0, 0.0], scale_by_std=False) == pytest.approx([5.0, -5.0])
    # standardised: scale-free up to the epsilon (std sqrt(50) vs sqrt(0.5), each + 1e-4)
    assert group_advantages([10.0, 0.0]) == pytest.approx([5 / (math.sqrt(50) + 1e-4), -5 / (math.sqrt(50) + 1e-4)])
    assert group_advantages([1.0, 0.0]) == pytest.approx(
        [0.5 / (math.sqrt(0.5) + 1e-4), -0.5 / (math.sqrt(0.5) + 1e-4)]
    )
    assert group_advantages([10.0, 0.0]) == pytest.approx(group_advantages([1.0, 0.0]), rel=2e-4)


@pytest.mark.parametrize("rewards", [[], [1.0]])
def test_group_smaller_than_two_raises_naming_completions_per_prompt(rewards):
    with pytest.raises(ValueError, match="completions_per_prompt must be >= 2"):
        group_advantages(rewards)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), None, "1"])
def test_non_finite_reward_raises(bad):
    with pytest.raises(ValueError, match=r"rewards_G\[1\]"):
        group_advantages([0.0, bad, 1.0])


def test_integer_rewards_accepted():
    expected = 0.5 / (math.sqrt(0.5) + 1e-4)
    assert group_advantages([1, 0]) == pytest.approx([expected, -expected], rel=1e-7)


def test_targets_are_normalised_by_the_groups_run_rewards():
    # runs with returns 0 and 2 (mean 1, unbiased std sqrt(2)); a run's calls credited 0.5 and 2
    adv = group_advantages([0.0, 2.0], targets=[0.0, 0.5, 2.0])
    s = math.sqrt(2.0) + 1e-4
    assert adv == pytest.approx([-1 / s, -0.5 / s, 1 / s], abs=1e-6)
    assert group_advantages([1.0, 1.0], targets=[0.0, 3.0]) == [0.0, 0.0]  # zero variance: no signal
    assert group_advantages([0.0, 2.0], scale_by_std=False, targets=[3.0]) == [2.0]


def test_a_reward_gap_of_float_noise_gives_near_zero_advantages():
    """std + 1e-4 (TRL's epsilon): rewards 1e-7 apart are not blown up to ±1.25 as with std + 1e-8."""
    adv = group_advantages([0.5, 0.5 + 1e-7, 0.5, 0.5 + 1e-7])
    assert max(abs(a) for a in adv) < 1e-3
