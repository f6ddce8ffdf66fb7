"""Agent run data as step metrics: turn labels, drift, tool statuses, failure causes.

    from training.utils.rl.run_metrics import run_metrics
    metrics.update(run_metrics([m for g in groups for m in g.metadata.values()],
                               failure_causes=causes))   # causes: PromptGroup.failure_causes, summed

The agent rollouts (``training.agents.make_agent_rollout_fn``, ``training.proxy.make_proxy_rollout_fn``)
put these keys in ``RolloutRun.metadata``, each a field of their ``EpisodeFacts``
(``training/utils/rl/rollout/episode_facts.py``; all optional; any other key is ignored here and still
written to ``rollouts.jsonl``):

| key | type | meaning |
| --- | --- | --- |
| ``labels`` | ``{"NEW": n, "APPEND": n, "WIPE": n}`` | how calls relate (proxy: ``matching``; agents: turns) |
| ``drift`` | int | calls whose messages extend the previous call but whose re-rendered tokens do not |
| ``tool_status_counts`` | ``{status: n}`` | ``ok``, ``error``, ``timeout``, ``unknown_tool``, ``bad_arguments``, |
| | | ``no_result``, ``unparsable`` |
| ``num_calls`` | int | model calls of the episode |
| ``truncated`` | bool | a call or the episode hit a length limit |
| ``intermediate_rewards`` | list of float | per-call rewards (tool status, rewards the agent posted) |
| ``stop_reason`` | str | why the episode ended: ``STOP_REASONS`` of the contract module (``finish``, ``max_steps``, |
| | | ``timeout``, ``error``, ``length``) |
| ``reward_components`` | ``{name: float}`` | the reward's parts, e.g. a verifiers rubric's value per reward function |

Names returned (floats; a name appears only when some run carried its key):
``agent/episodes`` (runs with any key above), ``agent/labels_new`` / ``_append`` / ``_wipe``
(sums), ``agent/drift`` (sum), ``agent/calls_per_episode`` (mean), ``agent/tool_calls`` (every
status but ``unparsable``), ``agent/tool_<status>`` (sum per status), ``agent/tool_errors``
(every status but ``ok``, unparsable included), ``agent/truncated`` (episodes),
``agent/intermediate_reward_mean`` (mean per call), ``reward/<name>`` (mean of each reward component
over the runs that carry it); and ``rollout/failed/<cause>`` for each
failure cause counted by ``training.utils.rl.groups`` (``timeout``, ``upstream``,
``upstream_5xx``, ``agent_<exception>``, ``invalid_<field>``...).

Stop reasons, when some run carried ``stop_reason``: ``rollout/stop_reason/<reason>`` for each of
``STOP_REASONS``, the fraction of the step's episodes that ended so. The episodes are the runs with
a ``stop_reason`` plus the failed completions (failure cause ``timeout`` counts as ``timeout``, any
other as ``error``), so the fractions sum to 1.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Optional

from training.utils.rl.rollout import STOP_REASONS

AGENT_KEYS = (
    "labels",
    "drift",
    "tool_status_counts",
    "num_calls",
    "truncated",
    "intermediate_rewards",
    "stop_reason",
    "reward_components",
)
"""``RolloutRun.metadata`` keys read here."""


def run_metrics(
    metadata_list: Iterable[Mapping], failure_causes: Optional[Mapping[str, int]] = None
) -> dict[str, float]:
    """Step metrics from the runs' metadata and the failure causes (see the module docstring)."""
    out: dict[str, float] = {}
    episodes, calls, intermediate = 0, [], []
    stops: dict[str, float] = {}
    components: dict[str, list[float]] = {}

    def add(name: str, value: float) -> None:
        out[name] = out.get(name, 0.0) + float(value)

    for meta in metadata_list:
        if not isinstance(meta, Mapping) or not any(k in meta for k in AGENT_KEYS):
            continue
        episodes += 1
        for kind, n in (meta.get("labels") or {}).items():
            add(f"agent/labels_{str(kind).lower()}", n)
        if "drift" in meta:
            add("agent/drift", meta["drift"])
        for status, n in (meta.get("tool_status_counts") or {}).items():
            add(f"agent/tool_{status}", n)
            if status != "unparsable":
                add("agent/tool_calls", n)
            if status != "ok":
                add("agent/tool_errors", n)
        if "tool_status_counts" in meta:
            out.setdefault("agent/tool_calls", 0.0)
            out.setdefault("agent/tool_errors", 0.0)
        if "num_calls" in meta:
            calls.append(float(meta["num_calls"]))
        if "truncated" in meta:
            add("agent/truncated", 1.0 if meta["truncated"] else 0.0)
        intermediate += [float(x) for x in meta.get("intermediate_rewards") or [] if math.isfinite(float(x))]
        for name, value in (meta.get("reward_components") or {}).items():
            if math.isfinite(float(value)):
                components.setdefault(str(name), []).append(float(value))
        if meta.get("stop_reason") is not None:
            reason = str(meta["stop_reason"])
            stops[reason] = stops.get(reason, 0.0) + 1.0
    if episodes:
        out["agent/episodes"] = float(episodes)
    if calls:
        out["agent/calls_per_episode"] = sum(calls) / len(calls)
    if intermediate:
        out["agent/intermediate_reward_mean"] = sum(intermediate) / len(intermediate)
    for name, values in components.items():
        out[f"reward/{name}"] = sum(values) / len(values)
    for cause, n in (failure_causes or {}).items():
        out[f"rollout/failed/{cause}"] = out.get(f"rollout/failed/{cause}", 0.0) + float(n)
    out.update(stop_reason_fractions(stops, failure_causes))
    return out


def stop_reason_fractions(
    stop_counts: Mapping[str, float], failure_causes: Optional[Mapping[str, int]] = None
) -> dict[str, float]:
    """``rollout/stop_reason/<reason>``: each reason's share of the finished runs (``stop_counts``) and the
    failed completions (``timeout`` → ``timeout``, other causes → ``error``); {} when no run carried one."""
    if not stop_counts:
        return {}
    counts = {reason: 0.0 for reason in STOP_REASONS}
    for reason, n in stop_counts.items():
        counts[reason] = counts.get(reason, 0.0) + float(n)
    for cause, n in (failure_causes or {}).items():
        key = "timeout" if cause == "timeout" else "error"
        counts[key] += float(n)
    total = sum(counts.values())
    return {f"rollout/stop_reason/{reason}": n / total for reason, n in counts.items()} if total else {}
