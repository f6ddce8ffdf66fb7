"""Tool calculator: arithmetic word problems solved with tools inside the rollout.

The model sees the tool schemas (``calculator``, ``lookup_price``, ``finish``) through its chat
template, writes ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks, gets each
result back as a ``role: tool`` message and ends with ``finish(answer=...)`` (a reply without
any call counts as the answer). The episode is built token-in/token-out by
``training.agents.TrajectoryEngine``: ``loss_mask`` is 1 exactly on the tokens the server
generated; tool results and template glue are context (mask 0). Reward: 1.0 when the answer's
first number equals the row's ``answer``, else 0.0 (plus optional per-call shaping).
"""

import re

from calculator_tools import CalculatorTool, PriceLookupTool

from training.agents import IntermediateRewards, ToolAgent, ToolEnvironment, ToolManager, make_agent_rollout_fn
from training.utils.rl.rollout import RolloutSetup

SYSTEM = (
    "Solve the problem. Use calculator for arithmetic and lookup_price for prices, "
    "then call finish with the final number as the answer. Example: "
    '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>, then '
    '<tool_call>{"name": "finish", "arguments": {"answer": "5"}}</tool_call>'
)
MAX_STEPS = 4
"""Turns per episode; the episode ends (answer "") when the model has not finished by then."""
TOOL_TIMEOUT_S = 2.0
"""Deadline of each tool call."""
MAX_TOTAL_TOKENS = 1024
"""Prompt + every turn; an episode that would grow past it stops with finish_reason "length"."""
INTERMEDIATE_REWARDS: IntermediateRewards | None = None
"""Set to ``IntermediateRewards(failed_call=-0.1, unparsable_call=-0.1)`` to penalise bad calls (off by default)."""


def parse_number(text: str) -> float | None:
    """The first number in ``text`` (commas allowed as thousands separators), or None."""
    m = re.search(r"-?\d[\d,]*(?:\.\d+)?", text or "")
    return float(m.group(0).replace(",", "")) if m else None


def reward_fn(answer: str, row: dict) -> float:
    """1.0 if the answer's first number equals ``row["answer"]``, else 0.0."""
    value = parse_number(answer)
    return 1.0 if value is not None and abs(value - float(row["answer"])) < 1e-6 else 0.0


def make_rollout_fn(setup: RolloutSetup):
    tools = ToolManager([CalculatorTool(), PriceLookupTool()], timeout_s=TOOL_TIMEOUT_S)
    return make_agent_rollout_fn(
        agent_factory=lambda row: ToolAgent([{"role": "system", "content": SYSTEM}] + row["messages"], parser="hermes"),
        env_factory=lambda row: ToolEnvironment(
            row, tools, reward_fn, max_steps=MAX_STEPS, intermediate_rewards=INTERMEDIATE_REWARDS
        ),
        max_total_tokens=MAX_TOTAL_TOKENS,
    )(setup)
