"""Multi-reward: named reward components per completion, their step metrics, and their weighted combination.

A rollout may return ``reward_components`` (``{name: float}``) beside its ``reward`` (``RolloutSample`` /
``RolloutRun``: the contract checks each value like ``reward``). The surviving completions of one group carry the
same names, or none does. ``Config.reward_weights`` decides what they do:

- None (the default): they are logged only, as ``rollout/reward/<name>_mean`` per step (over the completions the
  step trains) and ``reward_components`` on each ``rollouts.jsonl`` line; each completion trains on its ``reward``.
- ``{name: w}``: completion k of a group of G surviving completions trains on the weighted sum of its components,
  each first normalised within the group (GDPO-style: a component with a wide scale or many distinct values does
  not drown the others, and a component that does not vary in the group adds nothing)::

      R_k = sum_c w_c · (r_{c,k} - mean_G r_c) / (std_G r_c + 1e-4)      (std unbiased; the term is 0 for a
                                                                         component equal across the group)

  R_k replaces the ``reward`` the rollout returned (``rollouts.jsonl``'s ``reward`` is R_k; its components stay as
  returned), and the configured advantage estimator (``Config.advantage``) then runs on R as on any reward: grpo
  normalises the sum again within the group. A segment of a per-call-credit run keeps its per-call part: its reward
  moves by g_s · (R_k - the returned reward). A name in ``reward_weights`` that the group's completions do not
  return is an error naming it; a returned component without a weight gets weight 0 (a warning, once per name).

``RunContext.run_group`` applies it first on a finished group: before ``group_reward_fn`` (a judge sees the combined
rewards and may replace them) and overlong shaping (which adds its length penalty to R_k; a completion that
``overlong.filter_truncated`` then removes was part of the components' group statistics). Eval rollouts score
their returned ``reward``; their components are not read. A group that breaks
these rules trains nothing: its completions count as ``rollout/invalid``, under
``rollout/failed/invalid_reward_components``, and the failure is reported naming the row and the names.
"""

from __future__ import annotations

import logging
import math
from typing import Optional

from training.utils.rl.advantages import group_advantages
from training.utils.rl.failure_log import FailureLog, row_label
from training.utils.rl.groups import PromptGroup

logger = logging.getLogger(__name__)

FAILURE_CAUSE = "invalid_reward_components"
"""The cause a group that breaks the components' rules is counted under (``rollout/failed/<cause>``)."""

_warned_unweighted: set[str] = set()
"""Component names already warned about having no weight (the warning is printed once per name)."""


class RewardComponentsError(ValueError):
    """A group's ``reward_components`` break the rules of the module docstring."""


def component_names(components_G: list[Optional[dict[str, float]]]) -> Optional[list[str]]:
    """The component names every completion of a group returns (sorted), None when none returns any, or
    ``RewardComponentsError`` naming the completions whose names differ from the first one's."""
    if all(c is None for c in components_G):
        return None
    first = components_G[0]
    names = sorted(first) if first is not None else None
    for k, c in enumerate(components_G):
        mine = sorted(c) if c is not None else None
        if mine != names:
            raise RewardComponentsError(
                f"the completions of one group must return the same reward_components names: completion 0 returns "
                f"{names if names is not None else 'none'}, completion {k} {mine if mine is not None else 'none'}"
            )
    return names


def combine_components(components_G: list[dict[str, float]], weights: dict[str, float]) -> list[float]:
    """R_k = sum_c w_c · (r_{c,k} - mean_G r_c) / (std_G r_c + 1e-4) for each completion k (module docstring);
    a component without a weight counts with weight 0. ``RewardComponentsError`` for a weight whose name the
    completions do not return, or a group of fewer than two completions."""
    names = component_names(components_G) or []
    missing = sorted(set(weights) - set(names))
    if missing:
        raise RewardComponentsError(
            f"reward_weights names {missing}, which the group's completions do not return "
            f"(they return reward_components {names if names else 'none'})"
        )
    if len(components_G) < 2:
        raise RewardComponentsError(f"a group of {len(components_G)} completion(s) cannot be normalised")
    for name in names:
        if name not in weights and name not in _warned_unweighted:
            _warned_unweighted.add(name)
            logger.warning(
                "reward component %r has no weight in reward_weights: it counts with weight 0 (logged only)", name
            )
    combined_G = [0.0] * len(components_G)
    for name, w in weights.items():
        normalised_G = group_advantages([c[name] for c in components_G], "grpo")
        combined_G = [total + w * z for total, z in zip(combined_G, normalised_G)]
    return combined_G


def _mark_invalid(group: PromptGroup, error: RewardComponentsError, failure_log: Optional[FailureLog]) -> None:
    """Count every surviving completion of ``group`` as invalid (``FAILURE_CAUSE``) and empty the group."""
    marked = len(group.completion_rewards)
    group.invalid += marked
    group.failure_causes[FAILURE_CAUSE] = group.failure_causes.get(FAILURE_CAUSE, 0) + marked
    for part in (group.samples, group.completion_index, group.return_weights, group.advantages):
        part.clear()
    group.completion_rewards.clear()
    group.completion_components.clear()
    group.metadata.clear()
    if failure_log is not None:
        label = row_label(group.row, group.row_index, group.position)
        failure_log.problem(label, FAILURE_CAUSE, f"returned invalid reward_components: {error}")


def apply_reward_components(
    group: PromptGroup, weights: Optional[dict[str, float]], failure_log: Optional[FailureLog] = None
) -> bool:
    """Check ``group``'s components and, with ``weights``, replace each surviving completion's reward by R_k (module
    docstring). Returns False when the group broke the rules (it is then emptied and its completions counted
    invalid, reported to ``failure_log``); True otherwise, also for a group of fewer than two completions (left as
    it is: the recipe drops it as too small)."""
    keys = sorted(group.completion_rewards)
    components_G = [group.completion_components.get(k) for k in keys]
    try:
        component_names(components_G)  # the same names in every completion, or none
        if weights is None or len(keys) < 2:
            return True
        combined_G = combine_components([c or {} for c in components_G], weights)
    except RewardComponentsError as e:
        _mark_invalid(group, e, failure_log)
        return False
    for k, reward in zip(keys, combined_G):
        group.set_completion_reward(k, reward)
    return True


def component_metrics(groups: list[PromptGroup]) -> dict[str, float]:
    """``rollout/reward/<name>_mean``: each component's mean over the surviving completions of ``groups`` that
    return it (as returned, before any combination); {} when none does."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for k in sorted(g.completion_rewards):
            for name, v in (g.completion_components.get(k) or {}).items():
                values.setdefault(name, []).append(v)
    return {f"rollout/reward/{name}_mean": math.fsum(vs) / len(vs) for name, vs in sorted(values.items())}
