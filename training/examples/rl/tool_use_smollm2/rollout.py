"""Tool use on SmolLM2: call a calculator, read its result, answer with the number.

SmolLM2-135M-Instruct gets two- and three-digit arithmetic wrong on its own and was not trained
to call tools. The prompt shows it the format (a short warm-up: three solved exchanges in the
history, in the Hermes ``<tool_call>`` format the parser reads); RL does the rest. Each episode,
token-in/token-out through ``training.agents``:

1. the model writes a reply; ``<tool_call>{"name": "calculator", "arguments": {"expression": ...}}``
   blocks are parsed and run (``FunctionTool(calculator)``: its schema, from the signature and
   docstring, checks the arguments; the prompt shows examples instead of the schema), each
   result comes back as a ``role: tool`` message;
2. a reply without a call is the answer (at most ``MAX_STEPS`` turns);
3. reward: 1.0 when the answer's first number is right, plus ``-0.1`` per failed or unparsable
   call (intermediate rewards, part of the episode's return).
"""

import ast
import operator
import re

from training.agents import FunctionTool, IntermediateRewards, ToolAgent, ToolEnvironment, ToolManager
from training.agents import make_agent_rollout_fn
from training.utils.rl.rollout import RolloutSetup

SYSTEM = (
    "You are a calculator assistant. For arithmetic, call the calculator tool, then reply with the number it returned."
)


def _solved(expression: str, value: int) -> list[dict]:
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "%s"}}\n</tool_call>' % expression
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": call},
        {"role": "tool", "content": str(value)},
        {"role": "assistant", "content": str(value)},
    ]


WARM_UP = _solved("23 + 19", 42) + _solved("57 * 31", 1767) + _solved("604 - 38", 566)
"""Solved exchanges shown before every question, one per kind of problem (with one, SmolLM2 solved 0 of 48)."""
MAX_STEPS = 3
"""Turns per episode (a call, its answer, one retry)."""
MAX_TOTAL_TOKENS = 512
"""Prompt + every turn of an episode."""
SAMPLING = {"stop": ["</tool_call>"]}
"""A turn that calls the tool ends with the call (the stop string's tokens stay in the output)."""
SHAPING = IntermediateRewards(failed_call=-0.1, unparsable_call=-0.1)
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculator(expression: str) -> int:
    """Evaluate an arithmetic expression.

    Args:
        expression: Integers with +, -, * and parentheses, e.g. "12 * (3 + 4)".
    """

    def ev(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**9:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only integers with + - * and parentheses")

    if len(expression) > 100:
        raise ValueError("expression longer than 100 characters")
    return ev(ast.parse(expression.strip(), mode="eval").body)


TOOLS = ToolManager([FunctionTool(calculator)], timeout_s=2.0)


def parse_number(text: str) -> int | None:
    m = re.search(r"-?\d+", (text or "").replace(",", ""))
    return int(m.group(0)) if m else None


def reward_fn(answer: str, row: dict) -> float:
    """1.0 when the answer's first integer is the row's answer, else 0.0."""
    return 1.0 if parse_number(answer) == int(row["answer"]) else 0.0


def make_rollout_fn(setup: RolloutSetup):
    return make_agent_rollout_fn(
        agent_factory=lambda row: ToolAgent(
            [{"role": "system", "content": SYSTEM}] + WARM_UP + row["messages"], tools=[], parser="hermes"
        ),  # tools=[]: the prompt shows the format
        env_factory=lambda row: ToolEnvironment(
            row, TOOLS, reward_fn, max_steps=MAX_STEPS, intermediate_rewards=SHAPING
        ),
        max_total_tokens=MAX_TOTAL_TOKENS,
        sampling=SAMPLING,
    )(setup)
