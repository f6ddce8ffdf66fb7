"""Template check: does re-rendering a conversation only append, turn after turn?

Renders a scripted conversation (tools, a ``<think>`` block, two tool messages in a row, an
assistant turn that is only a tool call with ``content: None`` as OpenAI-SDK agents send it, a
follow-up user turn) through the tokenizer's chat template, after the same normalisation the
server applies (``training.openai_api.chat_messages.prepare_for_template``). For each assistant turn
k it compares the tokens of the prompt the model saw at turn k (history + generation prompt)
followed by the reply as the model writes it (content, then tool calls as Hermes blocks) with
the tokens of the whole conversation rendered later. ``appends=False`` means a re-rendering
agent drifts there: the next prompt does not start with what the model saw and produced
(``TrajectoryEngine`` never re-renders, so it is unaffected; a black-box agent behind the proxy
gets a new segment at that turn).

A template that ignores ``tools`` (``tools_dropped_message``: rendering with and without tool schemas
gives the same prompt) fails the check too: the drift check above then runs on the system-prompt
fallback the server uses for such templates (``tool_rendering: "system_prompt"``), which the model
was never trained on through its template.

``run_template_check`` is what the rollout factories call before training
(``make_proxy_rollout_fn``, ``make_agent_rollout_fn``): ``warn`` logs each drifting turn with its
reason, ``error`` raises ``TemplateCheckError``, ``off`` skips. On the command line:
``python -m training.agents.template_check MODEL`` (``tiny``, ``smollm2``, a folder or hub id).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from training.openai_api.chat_messages import assistant_text, prepare_for_template
from training.openai_api.tool_parsers import messages_with_tools, template_renders_tools

logger = logging.getLogger(__name__)

CHECK_MODES = ("warn", "error", "off")

SCRIPT_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]

SCRIPT = [
    {"role": "system", "content": "You solve problems with tools."},
    {"role": "user", "content": "What is 17 + 25, and 3 * 4?"},
    {
        "role": "assistant",
        "content": "<think>\nTwo sums.\n</think>\n\n"
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 + 25"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "calculator", "arguments": {"expression": "3 * 4"}}\n</tool_call>',
    },
    {"role": "tool", "content": "42"},
    {"role": "tool", "content": "12"},
    {"role": "assistant", "content": "<think>\nDone.\n</think>\n\n42 and 12."},
    {"role": "user", "content": "Thanks. And 2 + 2?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_7",
                "type": "function",
                "function": {"name": "calculator", "arguments": '{"expression": "2 + 2"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_7", "content": "4"},
    {"role": "assistant", "content": "4"},
]
"""The scripted conversation (OpenAI shape, as an SDK agent sends it)."""


class TemplateCheckError(RuntimeError):
    """The chat template cannot render the scripted conversation, or (``mode="error"``) a turn drifts."""


@dataclass
class TurnCheck:
    """One assistant turn of the script."""

    turn: int
    """Index of the assistant message in the script."""
    appends: bool
    """True if the final rendering starts with the tokens of this turn's prompt + reply."""
    reason: str
    """Empty when ``appends``; else what changed (thinking stripped, first differing token)."""


def _ids(
    tokenizer: Any, messages: list[dict], tools: Optional[list[dict]], generation_prompt: bool, template_kwargs: dict
) -> list[int]:
    msgs, tools_arg = messages_with_tools(tokenizer, messages, tools)
    return list(
        tokenizer.apply_chat_template(
            msgs,
            tools=tools_arg,
            add_generation_prompt=generation_prompt,
            tokenize=True,
            return_dict=False,
            **template_kwargs,
        )
    )


def check_template_appends(
    tokenizer: Any, messages: Optional[list[dict]] = None, tools: Optional[list[dict]] = None, **template_kwargs: Any
) -> list[TurnCheck]:
    """Per assistant turn: does the full conversation's rendering extend what the model saw then?

    ``messages`` may be OpenAI-SDK shaped (normalised first); ``template_kwargs`` go to
    ``apply_chat_template`` (``enable_thinking=False``...). A template that raises propagates.
    """
    original = messages or SCRIPT
    tools = SCRIPT_TOOLS if tools is None and messages is None else tools
    normal = prepare_for_template(original, tokenizer)
    full = _ids(tokenizer, normal, tools, False, template_kwargs)
    full_text = tokenizer.decode(full)
    checks = []
    for i, m in enumerate(normal):
        if m["role"] != "assistant":
            continue
        seen = _ids(tokenizer, normal[:i], tools, True, template_kwargs)
        reply_text = assistant_text(prepare_for_template([original[i]])[0])
        expected = seen + list(tokenizer.encode(reply_text, add_special_tokens=False))
        if full[: len(expected)] == expected:
            checks.append(TurnCheck(i, True, ""))
            continue
        k = next((j for j, (a, b) in enumerate(zip(full, expected)) if a != b), min(len(full), len(expected)))
        if "<think>" in reply_text and reply_text.split("</think>")[0] not in full_text:
            reason = "thinking stripped from an earlier turn"
        elif full[: len(seen)] == seen:
            reason = f"the reply re-renders or re-tokenizes differently (first difference at token {k})"
        else:
            reason = f"the prompt changed on re-rendering (first difference at token {k})"
        checks.append(TurnCheck(i, False, reason))
    return checks


def run_template_check(
    tokenizer: Any, mode: str = "warn", *, where: str = "rollout", **template_kwargs: Any
) -> list[TurnCheck]:
    """The check a rollout factory runs before training: log (``warn``) or raise (``error``) on drift.

    A template that cannot render the script at all raises ``TemplateCheckError`` in ``error``
    mode and is logged in ``warn`` mode. ``off`` (or no tokenizer) returns [] without rendering.
    """
    if mode not in CHECK_MODES:
        raise ValueError(f"template_check: {mode!r} is not one of {CHECK_MODES}")
    if mode == "off" or tokenizer is None or not getattr(tokenizer, "chat_template", None):
        return []
    try:
        checks = check_template_appends(tokenizer, **template_kwargs)
    except Exception as e:  # noqa: BLE001 - jinja errors name the template's problem
        message = (
            f"{where}: the chat template cannot render a tool conversation ({type(e).__name__}: {e}); "
            "tool-using episodes will fail (python -m training.agents.template_check MODEL)"
        )
        if mode == "error":
            raise TemplateCheckError(message) from e
        logger.warning(message)
        return []
    drifting = [c for c in checks if not c.appends]
    dropped = tools_dropped_message(tokenizer, where)
    if drifting:
        turns = "; ".join(f"assistant message {c.turn}: {c.reason}" for c in drifting)
        message = (
            f"{where}: re-rendering the conversation does not only append ({turns}); an agent that "
            "re-renders its history gets a new segment at each such turn (template_check='off' to skip)"
        )
        if mode == "error":
            raise TemplateCheckError(message)
        logger.warning(message)
    if dropped:
        if mode == "error":
            raise TemplateCheckError(dropped)
        logger.warning(dropped)
    return checks


def tools_dropped_message(tokenizer: Any, where: str = "rollout") -> str:
    """Empty when the chat template renders ``tools``; else why that fails the check and the fallback in use."""
    try:
        if template_renders_tools(tokenizer):
            return ""
    except Exception as e:  # noqa: BLE001 - a template that cannot render a probe also drops tools
        return f"{where}: the chat template cannot render tools ({type(e).__name__}: {e})"
    return (
        f"{where}: the chat template ignores 'tools' (the prompt is the same with and without tool schemas), so "
        "tool-using agents would get no tool definitions from it. The deployment server and TrajectoryEngine "
        "use the system-prompt fallback instead (training.openai_api.tool_parsers.messages_with_tools; responses say "
        "tool_rendering='system_prompt'); train on that knowingly (template_check='warn') or give the "
        "tokenizer a chat template that renders 'tools'"
    )
