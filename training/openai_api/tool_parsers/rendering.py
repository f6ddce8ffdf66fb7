"""Tool schemas -> the prompt: the chat template's own ``tools`` rendering, or the system-prompt fallback.

``render_prompt_ids`` renders messages plus tool schemas through the tokenizer's chat template (``tools=``); for
templates that ignore ``tools`` (detected once per template by ``template_renders_tools``) it lists the schemas
in the system message. The deployment server uses the same ``messages_with_tools`` and reports which in
``tool_rendering``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Optional

logger = logging.getLogger("training.openai_api.tool_parsers")

TOOL_RENDERINGS = ("template", "system_prompt")
"""How tool schemas reach the prompt: the chat template's own ``tools`` rendering, or (templates that
ignore ``tools``) the system-prompt fallback ``tools_system_text``."""

_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "probe_tool_4f1c",
        "description": "A probe.",
        "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
    },
}
_RENDERS_TOOLS: dict[tuple[str, str], bool] = {}


def template_renders_tools(tokenizer: Any, tools: Optional[list[dict]] = None) -> bool:
    """True if the chat template writes tool schemas when given ``tools=``.

    Renders a one-message conversation with and without a probe tool and compares; the answer is
    cached per (tokenizer name, chat template), and the first answer of a process is logged once.
    ``tools`` is accepted for compatibility and ignored (the probe decides).
    """
    template = getattr(tokenizer, "chat_template", None)
    key = (str(getattr(tokenizer, "name_or_path", "")), template if isinstance(template, str) else repr(template))
    if key not in _RENDERS_TOOLS:
        probe = [{"role": "user", "content": "hi"}]
        without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
        try:  # a template that fails on ``tools`` cannot render them either: the fallback then
            with_tools = tokenizer.apply_chat_template(
                probe, tools=[_PROBE_TOOL], tokenize=False, add_generation_prompt=True
            )
        except Exception:  # noqa: BLE001 - jinja errors of any kind
            with_tools = without
        _RENDERS_TOOLS[key] = with_tools != without and "probe_tool_4f1c" in with_tools
        name = key[0] or "this tokenizer"
        if _RENDERS_TOOLS[key]:
            logger.info("tool schemas of %s are rendered by its chat template", name)
        else:
            logger.warning(
                "the chat template of %s ignores 'tools': tool schemas are rendered by the system-prompt fallback "
                "(tool_rendering='system_prompt')",
                name,
            )
    return _RENDERS_TOOLS[key]


def tool_rendering(tokenizer: Any) -> str:
    """``template`` when the chat template renders ``tools``, else ``system_prompt`` (see ``TOOL_RENDERINGS``)."""
    return "template" if template_renders_tools(tokenizer) else "system_prompt"


def tools_system_text(tools: list[dict]) -> str:
    """Hermes-style tool instructions for templates that do not render ``tools`` themselves."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>\n"
        + lines
        + '\n</tools>\n\nCall a function with <tool_call>{"name": ..., "arguments": ...}</tool_call>'
    )


def messages_with_tools(
    tokenizer: Any, messages: list[dict], tools: Optional[list[dict]]
) -> tuple[list[dict], Optional[list[dict]]]:
    """(messages, tools) to hand ``apply_chat_template``: ``tools=`` when the template renders them,
    else the schemas moved into the system message (and ``tools`` None)."""
    if not tools or template_renders_tools(tokenizer, tools):
        return messages, tools or None
    text = tools_system_text(tools)
    if messages and messages[0].get("role") == "system":
        first = dict(messages[0], content=f"{messages[0].get('content') or ''}\n\n{text}")
        return [first] + list(messages[1:]), None
    return [{"role": "system", "content": text}] + list(messages), None


def render_prompt_ids(
    tokenizer: Any, messages: list[dict], tools: Optional[list[dict]] = None, **template_kwargs: Any
) -> list[int]:
    """Token ids of ``messages`` (+ tool schemas) through the chat template, ending with the assistant header."""
    messages, tools = messages_with_tools(tokenizer, messages, tools)
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **template_kwargs
    )
    return list(ids)
