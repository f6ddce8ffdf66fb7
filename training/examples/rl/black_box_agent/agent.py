"""A plain OpenAI-SDK agent: a multi-turn solver that calls a ``calculator`` tool.

It knows nothing about training: it takes a base URL and an API key like any OpenAI client
and returns its final answer as text. ``rollout.py`` points it at the training proxy.
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

SYSTEM = (
    "Solve the problem. Call the calculator tool for arithmetic, then reply with the final number only. "
    'Example: <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3"}}</tool_call>'
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def _solved(expression: str, value: str, call_id: str) -> list[dict]:
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": "calculator", "arguments": json.dumps({"expression": expression})},
    }
    return [
        {"role": "user", "content": f"What is {expression}?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": value},
        {"role": "assistant", "content": value},
    ]


EXAMPLES = (
    _solved("23 + 19", "42", "call_0") + _solved("57 * 31", "1767", "call_1") + _solved("604 - 38", "566", "call_2")
)
"""Solved exchanges in the OpenAI tools format, sent before the question: small models copy their shape."""
_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def calculator(expression: str) -> str:
    """Evaluate ``expression`` (numbers and + - * / only); errors come back as text for the model."""

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError("only numbers and + - * / are allowed")

    try:
        value = ev(ast.parse(str(expression), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError, RecursionError) as e:
        return f"error: {e}"
    return str(int(value)) if float(value).is_integer() else str(value)


def solve(
    question: str, *, base_url: str, api_key: str, model: str = "gpt-4o-mini", max_turns: int = 3, max_tokens: int = 32
) -> str:
    """Ask the model, run its calculator calls, return its final reply ("" if it never gives one)."""
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, *EXAMPLES, {"role": "user", "content": question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=max_tokens)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments or "{}")
                result = (
                    calculator(args.get("expression", ""))
                    if call.function.name == "calculator"
                    else f"error: unknown tool {call.function.name}"
                )
            except (json.JSONDecodeError, AttributeError) as e:
                result = f"error: bad arguments ({e})"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return ""
