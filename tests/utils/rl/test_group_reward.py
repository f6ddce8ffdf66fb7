"""A group reward scores the finished group; when it raises, the group is marked failed (counted, emptied), never
scored 0."""

import asyncio

from training.recipes.async_rl_loop import Config
from training.recipes.step_metrics import StepCounters
from training.utils.rl.failure_log import FailureLog
from training.utils.rl.group_reward import GroupRewardError, apply_group_reward, group_reward_metrics
from training.utils.rl.groups import run_group
from training.utils.rl.rollout import RolloutSample


def _group(n: int = 3, fail_k=None):
    calls = {"k": 0}

    async def rollout_fn(row):
        k = calls["k"]
        calls["k"] += 1
        if k == fail_k:
            raise RuntimeError("this completion failed")
        return RolloutSample(
            tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], reward=0.0, text=f"m{k}"
        )

    return asyncio.run(run_group(rollout_fn, {"prompt": "p"}, 0, 0, n, 30.0, asyncio.Semaphore(8)))


def test_group_reward_sets_the_rewards_of_the_surviving_completions():
    group = _group(3)

    async def by_length(g):
        for k in g.completion_rewards:
            g.completion_rewards[k] = float(k)

    asyncio.run(apply_group_reward(by_length, group))
    assert group.rewards == [0.0, 1.0, 2.0]


def test_a_raising_group_reward_marks_the_group_failed_and_counts_each_member():
    group = _group(4, fail_k=1)  # one completion already failed on its own
    assert len(group.completion_rewards) == 3 and group.errors == 1

    async def broken_judge(g):
        raise GroupRewardError("the judge answered nothing parseable", failure_cause="judge")

    log = FailureLog("rollout")
    asyncio.run(apply_group_reward(broken_judge, group, log))
    assert group.samples == [] and group.completion_rewards == {} and group.rewards == []
    assert group.errors == 4 and group.failure_causes["judge"] == 3
    counters = StepCounters()
    counters.add(group)
    assert counters.metrics()["rollout/failed/judge"] == 3.0


def test_a_group_of_fewer_than_two_survivors_is_not_scored():
    group = _group(2, fail_k=0)
    called = []

    async def fn(g):
        called.append(g)

    asyncio.run(apply_group_reward(fn, group))
    assert called == []


def test_metrics_come_from_take_metrics_when_the_reward_has_it():
    class WithMetrics:
        async def __call__(self, g):
            pass

        def take_metrics(self):
            return {"judge/calls": 2.0}

    assert group_reward_metrics(WithMetrics()) == {"judge/calls": 2.0}
    assert group_reward_metrics(lambda g: None) == {}
    assert group_reward_metrics(None) == {}


def test_config_takes_a_group_reward_and_names_it_in_its_record():
    async def judge_rewards(g):
        pass

    cfg = Config(base_model="tiny", group_reward_fn=judge_rewards)
    assert cfg.to_dict()["group_reward_fn"] == "judge_rewards"
    try:
        Config(base_model="tiny", group_reward_fn="judge")
    except ValueError as e:
        assert "group_reward_fn" in str(e)
    else:
        raise AssertionError("a non-callable group_reward_fn was accepted")
