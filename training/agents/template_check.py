"""Template check: does re-rendering a conversation only append, turn after turn?

    python -m training.agents.template_check MODEL_OR_FOLDER

Renders a scripted conversation (tools, a ``<think>`` block, two tool messages in a row, a
follow-up user turn) through the tokenizer's chat template. For each assistant turn k it
compares the tokens of the prompt the model saw at turn k (history + generation prompt)
with the tokens of the whole conversation re-rendered later. ``appends=False`` means a
re-rendering agent would drift there (the next prompt does not start with what the model
saw and produced); ``TrajectoryEngine`` never re-renders, so it is unaffected, but a black-box
agent behind a proxy would get a new segment at that turn.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Optional

from training.utils.tool_parsers import messages_with_tools

SCRIPT_TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]

SCRIPT = [
    {"role": "system", "content": "You solve problems with tools."},
    {"role": "user", "content": "What is 17 + 25, and 3 * 4?"},
    {"role": "assistant", "content": "<think>\nTwo sums.\n</think>\n\n"
     '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>'},
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n42 and 12."},
    {"role": "user", "content": "Thanks. And 2 + 2?"},
    {"role": "assistant", "content": "4"},
]


@dataclass
class TurnCheck:
    """One assistant turn of the script."""

    turn: int
    """Index of the assistant message in the script."""
    appends: bool
    """True if the final rendering starts with the tokens of this turn's prompt + reply."""
    reason: str
    """Empty when ``appends``; else what changed (thinking stripped, first differing token)."""


def _ids(tokenizer: Any, messages: list[dict], tools: Optional[list[dict]], generation_prompt: bool) -> list[int]:
    msgs, tools_arg = messages_with_tools(tokenizer, messages, tools)
    return list(tokenizer.apply_chat_template(msgs, tools=tools_arg, add_generation_prompt=generation_prompt,
                                              tokenize=True, return_dict=False))


def check_template_appends(tokenizer: Any, messages: Optional[list[dict]] = None,
                           tools: Optional[list[dict]] = None) -> list[TurnCheck]:
    """Per assistant turn: does the full conversation's rendering extend what the model saw then?"""
    messages = messages or SCRIPT
    tools = SCRIPT_TOOLS if tools is None and messages is SCRIPT else tools
    full = _ids(tokenizer, messages, tools, generation_prompt=False)
    full_text = tokenizer.decode(full)
    checks = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        seen = _ids(tokenizer, messages[:i], tools, generation_prompt=True)
        reply = list(tokenizer.encode(m["content"], add_special_tokens=False))
        expected = seen + reply
        if full[:len(expected)] == expected:
            checks.append(TurnCheck(i, True, ""))
            continue
        k = next((j for j, (a, b) in enumerate(zip(full, expected)) if a != b), min(len(full), len(expected)))
        if "<think>" in m["content"] and m["content"].split("</think>")[0] not in full_text:
            reason = "thinking stripped from an earlier turn"
        elif full[:len(seen)] == seen:
            reason = f"the reply re-tokenizes differently (first difference at token {k})"
        else:
            reason = f"the prompt changed on re-rendering (first difference at token {k})"
        checks.append(TurnCheck(i, False, reason))
    return checks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="a folder or hub id whose tokenizer to check (or 'tiny')")
    a = p.parse_args()
    from transformers import AutoTokenizer

    path = a.model
    if path == "tiny":
        from training.models.build_tiny import ensure_tiny_model
        path = ensure_tiny_model()
    for c in check_template_appends(AutoTokenizer.from_pretrained(path)):
        print(f"assistant message {c.turn}: {'appends' if c.appends else 'DRIFTS: ' + c.reason}")


if __name__ == "__main__":
    main()
