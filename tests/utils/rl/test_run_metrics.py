"""``run_metrics``: what an agent run puts in ``RolloutRun.metadata`` becomes named step metrics."""

import asyncio

import pytest

from training.utils.rl.groups import run_group
from training.utils.rl.rollout import RolloutRun, RolloutSample
from training.utils.rl.run_metrics import run_metrics


def test_labels_drift_tool_statuses_and_failure_causes_become_metrics():
    proxy_run = {
        "labels": {"NEW": 1, "APPEND": 2, "WIPE": 1},
        "drift": 1,
        "num_calls": 4,
        "truncated": False,
        "tool_status_counts": {"ok": 2, "error": 1, "unparsable": 1},
        "intermediate_rewards": [0, -0.5, 0, 0],
    }
    agent_run = {
        "labels": {"NEW": 1, "APPEND": 1, "WIPE": 0},
        "drift": 0,
        "num_calls": 2,
        "truncated": True,
        "tool_status_counts": {"timeout": 1},
    }
    out = run_metrics([proxy_run, agent_run, {"unrelated": 1}], failure_causes={"upstream_5xx": 2, "timeout": 1})
    assert out == pytest.approx(
        {
            "agent/episodes": 2,
            "agent/labels_new": 2,
            "agent/labels_append": 3,
            "agent/labels_wipe": 1,
            "agent/drift": 1,
            "agent/calls_per_episode": 3,
            "agent/truncated": 1,
            "agent/tool_ok": 2,
            "agent/tool_error": 1,
            "agent/tool_unparsable": 1,
            "agent/tool_timeout": 1,
            "agent/tool_calls": 4,
            "agent/tool_errors": 3,
            "agent/intermediate_reward_mean": -0.125,
            "rollout/failed/upstream_5xx": 2,
            "rollout/failed/timeout": 1,
        }
    )
    assert run_metrics([]) == {} and run_metrics([{"x": 1}]) == {}


def test_groups_count_failures_by_cause_and_keep_run_metadata():
    class Upstream503(RuntimeError):
        status = 503

    results = [
        Upstream503("boom"),
        KeyError("agent bug"),
        RolloutSample([1, 2], [0.0, 0.0], [0, 0], 1.0),
        RolloutRun([RolloutSample([1, 2], [0.0, -0.1], [0, 1], 0.0)], 1.0, metadata={"labels": {"NEW": 1}}),
    ]

    async def rollout_fn(row):
        r = results.pop(0)
        if isinstance(r, BaseException):
            raise r
        return r

    group = asyncio.run(run_group(rollout_fn, {}, 0, 0, 4, 10.0, asyncio.Semaphore(1)))
    assert group.failure_causes == {"upstream_5xx": 1, "exception_keyerror": 1, "invalid_loss_mask": 1}
    assert group.errors == 2 and group.invalid == 1
    out = run_metrics(group.metadata.values(), group.failure_causes)
    assert out["agent/labels_new"] == 1 and out["rollout/failed/invalid_loss_mask"] == 1


def test_the_recipe_step_counters_report_agent_metrics_and_failure_causes():
    """What ``run_group`` collects reaches the step's metrics (``StepCounters``, used by both recipes)."""
    from training.recipes.step_metrics import StepCounters
    from training.utils.rl.groups import PromptGroup

    counters = StepCounters()
    for causes, labels in (({"timeout": 1}, {"NEW": 1, "APPEND": 2, "WIPE": 0}), ({"upstream_5xx": 2}, None)):
        g = PromptGroup(position=0, row={}, submit_version=0)
        g.failure_causes = dict(causes)
        if labels:
            g.metadata[0] = {"labels": labels, "num_calls": 3, "tool_status_counts": {"ok": 1, "error": 1}}
        counters.add(g)
    m = counters.metrics()
    assert m["agent/episodes"] == 1 and m["agent/labels_append"] == 2 and m["agent/tool_errors"] == 1
    assert m["rollout/failed/timeout"] == 1 and m["rollout/failed/upstream_5xx"] == 2


def test_stop_reasons_become_fractions_of_the_steps_episodes_failed_ones_included():
    """Four finished runs and two failed completions: each ``rollout/stop_reason/<reason>`` is a share of six."""
    from training.recipes.step_metrics import StepCounters
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import STOP_REASONS

    g = PromptGroup(position=0, row={}, submit_version=0)
    for i, reason in enumerate(("finish", "finish", "max_steps", "length")):
        g.metadata[i] = {"stop_reason": reason, "num_calls": 2}
    g.failure_causes = {"timeout": 1, "exception_keyerror": 1}
    counters = StepCounters()
    counters.add(g)
    m = counters.metrics()
    assert {k: m[k] for k in m if k.startswith("rollout/stop_reason/")} == pytest.approx(
        {f"rollout/stop_reason/{r}": n / 6 for r, n in zip(STOP_REASONS, (2, 1, 1, 1, 1))}
    )
    assert not any(k.startswith("rollout/stop_reason/") for k in run_metrics([{"num_calls": 1}], {"timeout": 3}))
