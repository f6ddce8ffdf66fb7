"""Environments: score an agent's actions. One environment per episode (single-use).

- ``TaskEnvironment``: one turn; ``reward = reward_fn(answer_text, task)``.
- ``ToolEnvironment``: runs the turn's tool calls through a ``ToolManager`` (in parallel, each
  under its deadline) and returns ``{"tool_outputs": {call_id: text}, "tool_statuses": {...}}``.
  The episode ends on a ``finish(answer=...)`` call, on a reply without any tool call (the
  reply is the answer, when ``answer_without_finish``), or after ``max_steps`` turns; then
  ``reward_fn(answer, task)`` scores the final answer (``""`` when there is none). When a
  turn holds ``finish`` beside other calls, ``finish`` wins and the others are not run.

Intermediate rewards (off by default): with ``IntermediateRewards`` set, each failed tool call
(status other than ``ok``) adds ``failed_call`` and each unparsable call adds
``unparsable_call`` to that step's reward. The episode return is the sum of step rewards.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from training.agents.agents import Action, StepResult
from training.agents.tools import OK, Tool, ToolManager, ToolResult

RewardFn = Callable[[str, dict], Union[float, Awaitable[float]]]
"""``reward_fn(answer, task) -> float`` (sync or async)."""

FINISH_TOOL = "finish"


class FinishTool(Tool):
    """The schema of ``finish(answer)``; the environment intercepts the call and ends the episode."""

    name = FINISH_TOOL
    description = "Submit the final answer and end the task."
    parameters = {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "The final answer."}},
        "required": ["answer"],
    }

    def apply(self, **kwargs: Any) -> Any:
        raise RuntimeError("finish is handled by the environment, not executed")


@dataclass
class IntermediateRewards:
    """Per-call shaping from tool status (added to the step's reward)."""

    failed_call: float = -0.1
    """Added per call whose status is not ``ok`` (error, timeout, unknown tool, bad arguments)."""
    unparsable_call: float = -0.1
    """Added per tool call that did not parse."""


async def _score(reward_fn: RewardFn, answer: str, task: dict) -> float:
    value = reward_fn(answer, task)
    if inspect.isawaitable(value):
        value = await value
    return float(value)


class Environment:
    """Base: ``await reset()`` opens the episode, ``await step(action) -> StepResult`` answers each turn,
    ``await truncate()`` scores an episode cut short. Single-use: the engine calls ``reset`` once, first."""

    task: dict

    async def reset(self) -> list[dict]:
        """Start the episode, before the first turn: the chat messages it opens with, appended to the agent's
        (default: none, the agent's task messages are the whole opening). A gym-style environment returns
        its first observation here (``training/envs/text_gym.py``)."""
        return []

    def reward_components(self) -> Optional[dict[str, float]]:
        """The final reward's parts by name, read once the episode is scored (``metadata["reward_components"]``,
        step metrics ``reward/<name>``); None (default) = not split."""
        return None

    async def step(self, action: Action) -> StepResult:
        raise NotImplementedError

    async def truncate(self, reason: str) -> float:
        """Final reward when the episode is cut before it ended (over-length): the score of no answer."""
        return 0.0

    def tool_schemas(self) -> Optional[list[dict]]:
        """Schemas the agent's prompt should list (None = no tools)."""
        return None


class TaskEnvironment(Environment):
    """One turn: the reply is scored by ``reward_fn(reply_text, task)``."""

    def __init__(self, task: dict, reward_fn: RewardFn):
        self.task = task
        self.reward_fn = reward_fn

    async def step(self, action: Action) -> StepResult:
        reward = await _score(self.reward_fn, action.text, self.task)
        return StepResult(observation={}, reward=reward, done=True, info={"answer": action.text})

    async def truncate(self, reason: str) -> float:
        return await _score(self.reward_fn, "", self.task)


class ToolEnvironment(Environment):
    """Executes tool calls; ends on ``finish``, on a call-free reply, or at ``max_steps``."""

    def __init__(
        self,
        task: dict,
        tools: ToolManager,
        reward_fn: RewardFn,
        *,
        max_steps: int = 8,
        intermediate_rewards: Optional[IntermediateRewards] = None,
        answer_without_finish: bool = True,
        reminder: str = "Use the tools, then call finish with your answer.",
    ):
        if max_steps < 1:
            raise ValueError(f"max_steps: must be >= 1, got {max_steps}")
        if FINISH_TOOL in tools.tools:
            raise ValueError(f"tools: {FINISH_TOOL!r} is reserved for the environment's finish call")
        self.task = task
        self.tools = tools
        self.reward_fn = reward_fn
        self.max_steps = max_steps
        self.intermediate_rewards = intermediate_rewards
        self.answer_without_finish = answer_without_finish
        self.reminder = reminder
        self.num_steps = 0
        self.results: list[ToolResult] = []
        """Every executed call's result, in order (for logs and tests)."""

    def tool_schemas(self) -> list[dict]:
        return self.tools.schemas() + [FinishTool().schema()]

    def _shaping(self, results: list[ToolResult], n_parse_errors: int) -> float:
        ir = self.intermediate_rewards
        if ir is None:
            return 0.0
        return ir.failed_call * sum(1 for r in results if r.status != OK) + ir.unparsable_call * n_parse_errors

    async def _finish(self, answer: str, shaping: float, stop: str, obs: dict) -> StepResult:
        reward = await _score(self.reward_fn, answer, self.task)
        return StepResult(
            observation=obs,
            reward=reward + shaping,
            done=True,
            info={"answer": answer, "stop_reason": stop, "final_reward": reward},
        )

    async def step(self, action: Action) -> StepResult:
        self.num_steps += 1
        finish = next((c for c in action.tool_calls if c.name == FINISH_TOOL), None)
        calls = [c for c in action.tool_calls if c.name != FINISH_TOOL]
        if finish is not None:
            answer = finish.arguments.get("answer", "")
            answer = answer if isinstance(answer, str) else str(answer)
            return await self._finish(answer, self._shaping([], len(action.parse_errors)), "finish", {})
        if not calls and not action.parse_errors and self.answer_without_finish:
            return await self._finish(action.text, 0.0, "answer", {})
        results = await self.tools.execute_all(calls)
        self.results.extend(results)
        shaping = self._shaping(results, len(action.parse_errors))
        obs = {
            "tool_outputs": {r.call_id: r.output for r in results},
            "tool_statuses": {r.call_id: r.status for r in results},
            "parse_errors": list(action.parse_errors),
        }
        if not calls and not action.parse_errors:
            obs["text"] = self.reminder
        if self.num_steps >= self.max_steps:
            return await self._finish("", shaping, "max_steps", obs)
        return StepResult(observation=obs, reward=shaping, done=False)

    async def truncate(self, reason: str) -> float:
        return await _score(self.reward_fn, "", self.task)
