"""A rubric's reward is the weighted sum of its criteria; the components are named rewards in the metadata and the
step metrics; a criterion that fails marks the group."""

import asyncio

import pytest

from training.recipes.step_metrics import StepCounters
from training.rewards import Criterion, Rubric
from training.utils.rl.group_reward import apply_group_reward
from training.utils.rl.groups import run_group
from training.utils.rl.rollout import RolloutSample


def group_of(texts, rewards):
    it = iter(zip(texts, rewards))

    async def rollout_fn(row):
        text, reward = next(it)
        return RolloutSample(tokens=[1, 2], logprobs=[0.0, -0.1], loss_mask=[0, 1], reward=reward, text=text)

    return asyncio.run(run_group(rollout_fn, {"prompt": "p"}, 0, 0, len(texts), 60, asyncio.Semaphore(1)))


def test_weighted_sum_of_python_criteria_with_named_components():
    rubric = Rubric(
        [
            Criterion("short", 2.0, fn=lambda m: 1.0 if len(m.text) <= 3 else 0.0),
            Criterion("verifier", 1.0, fn=lambda m: m.reward),
            Criterion("rambling", -0.5, fn=lambda m: float(m.text.count("!"))),
        ]
    )
    group = group_of(["abc", "abcdef!!"], [0.25, 1.0])
    asyncio.run(rubric(group))
    assert group.rewards == [2.0 + 0.25, 0.0 + 1.0 - 1.0]
    assert group.metadata[1]["reward_components"] == {"short": 0.0, "verifier": 1.0, "rambling": 2.0}
    assert group.metadata[0]["rubric"]["short"] == {"weight": 2.0, "value": 1.0}
    counters = StepCounters()
    counters.add(group)
    assert counters.metrics()["reward/verifier"] == pytest.approx(0.625)


def test_a_failing_criterion_marks_the_group():
    rubric = Rubric([Criterion("broken", 1.0, fn=lambda m: 1 / 0)])
    group = group_of(["a", "b"], [0.0, 0.0])
    asyncio.run(apply_group_reward(rubric, group))
    assert group.failure_causes == {"rubric": 2} and group.samples == []
    group = group_of(["a", "b"], [0.0, 0.0])
    asyncio.run(apply_group_reward(Rubric([Criterion("nan", 1.0, fn=lambda m: float("nan"))]), group))
    assert group.failure_causes == {"rubric": 2}


def test_bad_criteria_are_refused_naming_the_problem():
    with pytest.raises(ValueError, match="exactly one"):
        Criterion("both", 1.0, judge="x", fn=lambda m: 0.0)
    with pytest.raises(ValueError, match="name"):
        Criterion("bad name", fn=lambda m: 0.0)
    with pytest.raises(ValueError, match="judge="):
        Rubric([Criterion("q", judge="Is it right?")])
    with pytest.raises(ValueError, match="differ"):
        Rubric([Criterion("a", fn=len), Criterion("a", fn=len)])
