"""Advantage estimators (``advantages.ADVANTAGE_ESTIMATORS``) against hand computations in float64: each group
formula, per-call credit, the step pass (``step_advantages``: reinforce_pp's batch scale, token advantages left as
given), distillation's task advantage, and ``Config.advantage`` with its older spelling."""

from __future__ import annotations

import math
import statistics

import pytest

from training.recipes.config import Config
from training.utils.cli import apply_overrides
from training.utils.config import ConfigError
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS, STD_EPSILON, credited_advantages, group_advantages
from training.utils.rl.distillation import distillation_advantages
from training.utils.rl.groups import PromptGroup
from training.utils.rl.losses import LossConfig
from training.utils.rl.rollout import RolloutSample
from training.utils.rl.step_advantages import set_step_advantages

REWARDS = [1.0, 0.0, 0.5, 0.25]  # mean 0.4375; unbiased std below


def test_the_registry_holds_the_documented_estimators_each_with_its_formula():
    assert {"grpo", "dr_grpo", "rloo", "reinforce_pp"} <= set(ADVANTAGE_ESTIMATORS)
    for name, estimator in ADVANTAGE_ESTIMATORS.items():
        assert estimator.name == name
        assert "A_i" in estimator.fn.__doc__ or "c_i" in estimator.fn.__doc__, name
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.batch_normalised] == ["reinforce_pp"]


def test_each_estimator_equals_its_hand_computation():
    mean = sum(REWARDS) / 4  # 0.4375
    std = math.sqrt(sum((r - mean) ** 2 for r in REWARDS) / 3)
    assert std == pytest.approx(statistics.stdev(REWARDS), rel=1e-15)
    hand = {
        "grpo": [(r - mean) / (std + 1e-4) for r in REWARDS],
        "dr_grpo": [r - mean for r in REWARDS],
        # leave-one-out: 1 - (0 + .5 + .25)/3, 0 - (1 + .5 + .25)/3, .5 - 1.25/3, .25 - 1.5/3
        "rloo": [1 - 0.25, 0 - 1.75 / 3, 0.5 - 1.25 / 3, 0.25 - 0.5],
        "reinforce_pp": [r - mean for r in REWARDS],  # the group part; the step divides by the batch std
    }
    for name, expected in hand.items():
        assert group_advantages(REWARDS, name) == pytest.approx(expected, rel=1e-14, abs=1e-15), name
    # rloo is the mean-centred advantage scaled by G / (G - 1)
    assert group_advantages(REWARDS, "rloo") == pytest.approx([4 / 3 * a for a in hand["dr_grpo"]], rel=1e-14)


def test_every_estimator_gives_a_zero_variance_group_zero():
    """Except a critic's (``gae``): its scalar is the value target, tested in ``test_gae.py``."""
    for name in (n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.critic):
        assert group_advantages([0.3, 0.3, 0.3], name) == [0.0, 0.0, 0.0], name


def test_the_older_switch_names_grpo_and_dr_grpo():
    assert group_advantages(REWARDS, True) == group_advantages(REWARDS, "grpo")
    assert group_advantages(REWARDS, False) == group_advantages(REWARDS, "dr_grpo")
    with pytest.raises(ValueError, match="advantage: unknown estimator 'ppo'"):
        group_advantages(REWARDS, "ppo")
    with pytest.raises(ValueError, match="targets"):
        group_advantages(REWARDS, "rloo", targets=[0.0])


def test_per_call_credit_uses_the_estimators_return_advantage():
    """Two completions (returns 1 and 0); completion 0 has two calls credited g = 1 and 0.5 with per-call rewards
    i = 0.1 and 0, completion 1 one call with i = -0.2: A_s = g_s·Â_c + (i_s - mean i)."""
    rewards_G, completion_S, g_S = [1.0, 0.0], [0, 0, 1], [1.0, 0.5, 1.0]
    i_S = [0.1, 0.0, -0.2]
    rewards_S = [g * rewards_G[c] + i for c, g, i in zip(completion_S, g_S, i_S)]
    mean_i = sum(i_S) / 3
    for name, returns in (("rloo", [1.0, -1.0]), ("dr_grpo", [0.5, -0.5])):  # rloo: 1 - 0, 0 - 1
        expected = [g * returns[c] + (i - mean_i) for c, g, i in zip(completion_S, g_S, i_S)]
        got = credited_advantages(rewards_G, completion_S, rewards_S, g_S, name)
        assert got == pytest.approx(expected, rel=1e-14, abs=1e-15), name


def group(position: int, rewards: list[float], token_advantages=None) -> PromptGroup:
    samples = [
        RolloutSample(tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.5], loss_mask=[0, 1, 1], reward=r) for r in rewards
    ]
    if token_advantages is not None:
        samples[0].token_advantages = token_advantages
    return PromptGroup(
        position=position,
        row={},
        submit_version=0,
        samples=samples,
        completion_index=list(range(len(rewards))),
        completion_rewards=dict(enumerate(rewards)),
    )


def test_reinforce_pp_divides_the_group_centred_rewards_by_the_step_batch_std():
    groups = [group(0, [1.0, 0.0]), group(1, [3.0, 1.0, 2.0]), group(2, [0.5, 0.5])]
    set_step_advantages(groups, "reinforce_pp")
    centred = [0.5, -0.5, 1.0, -1.0, 0.0, 0.0, 0.0]  # group means 0.5, 2, 0.5
    scale = 1 / (statistics.stdev(centred) + STD_EPSILON)
    got = [a for g in groups for a in g.advantages]
    assert got == pytest.approx([c * scale for c in centred], rel=1e-14, abs=1e-15)
    assert groups[2].advantages == [0.0, 0.0]  # no signal stays exactly no signal


def test_the_step_pass_keeps_a_rollouts_own_token_advantages_out_of_the_batch_statistics():
    own = [0.0, 9.0, -9.0]
    groups = [group(0, [1.0, 0.0, 0.0], token_advantages=own), group(1, [2.0, 0.0])]
    set_step_advantages(groups, "reinforce_pp")
    assert groups[0].advantages[0] == own
    centred = [-1 / 3, -1 / 3, 1.0, -1.0]  # the scalar advantages only
    scale = 1 / (statistics.stdev(centred) + STD_EPSILON)
    got = groups[0].advantages[1:] + groups[1].advantages
    assert got == pytest.approx([c * scale for c in centred], rel=1e-14)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "rloo"])
def test_group_estimators_are_not_rescaled_by_the_step(name):
    groups = [group(0, [1.0, 0.0, 0.25]), group(1, [3.0, 1.0])]
    set_step_advantages(groups, name)
    assert groups[0].advantages == group_advantages([1.0, 0.0, 0.25], name)
    assert groups[1].advantages == group_advantages([3.0, 1.0], name)


def test_the_default_step_pass_reproduces_the_groups_own_advantages():
    g = group(0, [1.0, 0.0, 0.25])
    g.compute_advantages()
    before = list(g.advantages)
    set_step_advantages([g], Config(base_model="tiny").advantage_estimator)
    assert g.advantages == before  # nothing changes unless a user asks


def test_distillation_reads_the_estimators_task_advantage():
    g = group(0, [1.0, 0.0])
    set_step_advantages([g], "rloo")  # A = +1, -1
    teacher = [0.0, -0.25, -1.0]
    a_T = distillation_advantages(g[0].loss_mask, g[0].logprobs, teacher, g.advantages[0], 1.0, 0.5)
    assert a_T == pytest.approx([0.0, (-0.25 + 0.5) + 0.5 * 1.0, (-1.0 + 0.5) + 0.5 * 1.0])


def test_config_advantage_and_its_older_spelling():
    assert Config(base_model="tiny").advantage_estimator == "grpo"
    assert Config(base_model="tiny", advantage_std_scaling=False).advantage_estimator == "dr_grpo"
    assert Config(base_model="tiny", advantage="dr_grpo", advantage_std_scaling=False).advantage_estimator == "dr_grpo"
    assert Config(base_model="tiny", advantage="rloo").advantage_estimator == "rloo"
    with pytest.raises(ConfigError, match="advantage: 'ppo' is not one of"):
        Config(base_model="tiny", advantage="ppo")
    with pytest.raises(ConfigError, match="advantage: advantage='rloo' and advantage_std_scaling=False conflict"):
        Config(base_model="tiny", advantage="rloo", advantage_std_scaling=False)


def test_either_spelling_works_as_a_command_line_override():
    base = Config(base_model="tiny")
    assert apply_overrides(base, ["advantage_std_scaling=false"]).advantage_estimator == "dr_grpo"
    assert apply_overrides(base, ["advantage=reinforce_pp"]).advantage_estimator == "reinforce_pp"
    with pytest.raises(SystemExit, match="advantage='rloo' and advantage_std_scaling=False conflict"):
        apply_overrides(base, ["advantage=rloo", "advantage_std_scaling=false"])


def test_the_config_record_names_the_estimator_only_when_the_older_switch_does_not():
    """A run recorded before ``advantage`` existed resumes: the default (and dr_grpo spelled the old way) leave the
    record as it was; another estimator is recorded."""
    assert "advantage" not in Config(base_model="tiny").to_dict()
    assert "advantage" not in Config(base_model="tiny", advantage_std_scaling=False).to_dict()
    assert Config(base_model="tiny", advantage="rloo").to_dict()["advantage"] == "rloo"
    loss = Config(base_model="tiny").to_dict()["loss"]
    assert not {"mis_level", "mis_low", "mis_high", "aggregation_constant"} & set(loss)
    recorded = Config(base_model="tiny", loss=LossConfig(mis_level="token")).to_dict()["loss"]
    assert recorded["mis_level"] == "token" and recorded["aggregation"] == "token_mean"
