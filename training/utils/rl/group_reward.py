"""Group-level rewards: a reward that scores the completions of one prompt group together.

    cfg = Config(..., group_reward_fn=judge)   # e.g. training.rewards.judge.GroupJudge

A group reward is ``async fn(group: PromptGroup) -> None``. The recipe awaits it on every finished training group,
after its completions ran and before the group is counted, filtered and given advantages (``RunContext.run_group``):
it sets ``group.completion_rewards[k]`` (and the samples' ``reward``) of the surviving completions and may add to
``group.metadata[k]`` (written to ``rollouts.jsonl``). A group with fewer than two surviving completions is not
scored (the recipe drops it as too small anyway).

Failure marks the group, never a silent 0: when the function raises, every surviving completion of the group is
counted as failed under the exception's cause (``groups.failure_cause``: an exception with ``failure_cause =
"judge"`` counts as ``rollout/failed/judge``), the group keeps no sample (so the recipe drops it as too small and
marks its row done) and the failure is reported to the run's ``FailureLog`` naming the row. These failures count
toward ``max_rollout_error_fraction`` like any other: a judge that keeps failing stops the run.

An object with a ``take_metrics() -> dict[str, float]`` method also reports step metrics (``group_reward_metrics``,
called once per step with the rollout counters).
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable, Optional

from training.utils.rl.failure_log import FailureLog, row_label
from training.utils.rl.groups import PromptGroup, failure_cause

logger = logging.getLogger(__name__)

GroupRewardFn = Callable[[PromptGroup], Awaitable[None]]
"""``async fn(group) -> None``: sets the rewards of the group's surviving completions (module docstring)."""


class GroupRewardError(RuntimeError):
    """A group reward could not score a group; ``failure_cause`` names why (``rollout/failed/<cause>``)."""

    def __init__(self, message: str, failure_cause: str = "group_reward"):
        super().__init__(message)
        self.failure_cause = failure_cause


def mark_group_failed(group: PromptGroup, error: BaseException, failure_log: Optional[FailureLog] = None) -> int:
    """Count every surviving completion of ``group`` as failed under ``error``'s cause and empty the group.

    Returns how many completions were marked. The group then has no sample and no reward: the recipe drops it
    (``rollout/too_small_groups``) and marks its row done."""
    marked = len(group.completion_rewards)
    cause = failure_cause(error)
    group.errors += marked
    group.failure_causes[cause] = group.failure_causes.get(cause, 0) + marked
    group.samples.clear()
    group.completion_index.clear()
    group.return_weights.clear()
    group.completion_rewards.clear()
    group.advantages.clear()
    group.metadata.clear()
    if failure_log is not None:
        failure_log.exception(row_label(group.row, group.row_index, group.position), error)
    return marked


async def apply_group_reward(
    fn: GroupRewardFn, group: PromptGroup, failure_log: Optional[FailureLog] = None
) -> PromptGroup:
    """Await ``fn(group)`` when the group has two or more surviving completions; on an exception (a cancellation passes)
    mark the group failed (``mark_group_failed``). Returns ``group``."""
    if len(group.completion_rewards) < 2:
        return group
    try:
        await fn(group)
    except Exception as e:  # noqa: BLE001 - a failed group reward marks the group, never stops the run by itself
        mark_group_failed(group, e, failure_log)
    return group


def group_reward_metrics(fn: Any) -> dict[str, float]:
    """``fn.take_metrics()`` when the group reward has that method, else {}."""
    take = getattr(fn, "take_metrics", None)
    return dict(take()) if callable(take) else {}
