"""Tool-call parsers: model text -> ``ToolCall`` list, and tool schemas -> the prompt.

On the ground floor because both the inference server (``deployment/server/protocol.py``, tool calls
in chat responses) and the agents (``training/agents``) parse the same formats.

Two formats:

- ``HermesToolParser`` (names ``hermes``, ``qwen``): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks anywhere in the text (Qwen2.5/Qwen3, Hermes). A trailing block without its closing
  tag (generation stopped on the ``</tool_call>`` stop string or ran out of tokens) is parsed too.
- ``JsonToolParser`` (name ``json``): the whole reply (optionally in a ```json fence) is one
  JSON object or a list of objects with ``name`` and ``arguments``.

``arguments`` may be an object or a JSON-encoded string (OpenAI style); ``parameters`` is
accepted as an alias. A block that is present but malformed never raises: it becomes an entry
of ``ParsedCalls.errors``, which the agent shows the model next turn (``format_parse_error``).

``render_prompt_ids`` renders messages plus tool schemas through the tokenizer's chat template
(``tools=``); for templates that ignore ``tools`` (detected once per template by
``template_renders_tools``) it lists the schemas in the system message. The deployment server
uses the same ``messages_with_tools`` and reports which in ``tool_rendering``.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)


@dataclass
class ToolCall:
    """One call the model asked for."""

    id: str
    """Call id, unique within an episode (keys ``tool_outputs``)."""
    name: str
    """Tool name as the model wrote it."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Decoded JSON arguments."""


_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


@dataclass
class ParsedCalls:
    """The result of parsing one reply."""

    calls: list[ToolCall] = field(default_factory=list)
    """Well-formed calls, in the order written."""
    errors: list[str] = field(default_factory=list)
    """One message per malformed call (what was wrong, and the text)."""
    content: str = ""
    """The reply without its tool-call blocks (the answer text when there are no calls)."""


def call_from_object(obj: Any, call_id: str) -> ToolCall:
    """A ``ToolCall`` from a decoded ``{"name", "arguments"}`` object; raises ValueError naming the problem."""
    if not isinstance(obj, dict):
        raise ValueError(f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("a tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"'arguments' of {name!r} is a string that is not JSON: {e.msg}") from e
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ValueError(f"'arguments' of {name!r} must be a JSON object, got {type(args).__name__}")
    return ToolCall(id=call_id, name=name, arguments=args)


def _short(text: str, limit: int = 200) -> str:
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


class ToolParser:
    """Base: ``parse(text) -> ParsedCalls``. Ids are ``{id_prefix}{i}`` in order of appearance."""

    name = ""

    def parse(self, text: str, id_prefix: str = "call_") -> ParsedCalls:
        raise NotImplementedError


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen / Hermes)."""

    name = "hermes"

    def parse(self, text: str, id_prefix: str = "call_") -> ParsedCalls:
        out = ParsedCalls()
        kept, pos = [], 0
        for m in _BLOCK_RE.finditer(text):
            kept.append(text[pos : m.start()])
            pos = m.end()
            body = m.group(1).strip()
            call_id = f"{id_prefix}{len(out.calls) + len(out.errors)}"
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {_short(body)}")
                continue
            try:
                out.calls.append(call_from_object(obj, call_id))
            except ValueError as e:
                out.errors.append(f"{e}: {_short(body)}")
        kept.append(text[pos:])
        out.content = "".join(kept).strip()
        return out


class JsonToolParser(ToolParser):
    """The whole reply is a JSON object or list of objects; a reply not starting with ``{``/``[`` is plain content."""

    name = "json"

    def parse(self, text: str, id_prefix: str = "call_") -> ParsedCalls:
        body = text.strip()
        fence = _FENCE_RE.match(body)
        if fence:
            body = fence.group(1).strip()
        if not body.startswith(("{", "[")):
            return ParsedCalls(content=text.strip())
        out = ParsedCalls()
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {_short(body)}")
            return out
        for i, item in enumerate(obj if isinstance(obj, list) else [obj]):
            try:
                out.calls.append(call_from_object(item, f"{id_prefix}{i}"))
            except ValueError as e:
                out.errors.append(f"{e}: {_short(json.dumps(item))}")
        return out


PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "qwen": HermesToolParser, "json": JsonToolParser}


def get_tool_parser(name: str) -> ToolParser:
    """A parser by name: ``hermes`` / ``qwen`` or ``json``."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_parser: {name!r} is not one of {sorted(PARSERS)}") from None


def format_parse_error(error: str) -> str:
    """The observation a malformed call turns into."""
    return (
        f"Error: could not parse your tool call: {error}. Write each call as "
        '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>.'
    )


def to_openai_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI ``message.tool_calls`` entries (arguments as a JSON string)."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ]


# ---------------------------------------------------------------- rendering tools into the prompt


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
