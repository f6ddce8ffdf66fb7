"""What every tool-call parser shares: ``ToolCall``, ``ParsedCalls``, the ``ToolParser`` contract, JSON call objects.

A parser turns one model reply into calls, errors and the leftover content, and never raises on model text:
a call that is present but malformed becomes an entry of ``ParsedCalls.errors``. Each parser also states, as
class attributes, the facts that streaming and forced calls need (``call_open`` / ``call_close`` /
``opens_at_start``; ``forced_prefix`` / ``forced_suffix`` / ``arguments_key``), so the server reads the
parser instead of knowing its family.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class ToolCall:
    """One call the model asked for."""

    id: str
    """Call id, unique within an episode (keys ``tool_outputs``)."""
    name: str
    """Tool name as the model wrote it."""
    arguments: dict[str, Any] = field(default_factory=dict)
    """Decoded JSON arguments."""


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
    """A ``ToolCall`` from a decoded ``{"name", "arguments"}`` object; raises ValueError naming the problem.

    ``parameters`` (Llama 3) is accepted for ``arguments``; ``arguments`` may be a JSON-encoded string."""
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


def split_blocks(pattern: re.Pattern[str], text: str) -> tuple[str, list[str]]:
    """``(content, bodies)``: ``text`` with every match of ``pattern`` cut out (the rest joined and stripped: the
    reply's plain content) and each match's first group, in order (the call blocks a parser then reads)."""
    kept, bodies, pos = [], [], 0
    for m in pattern.finditer(text):
        kept.append(text[pos : m.start()])
        bodies.append(m.group(1))
        pos = m.end()
    kept.append(text[pos:])
    return "".join(kept).strip(), bodies


def short(text: str, limit: int = 200) -> str:
    """``text`` stripped and cut to ``limit`` characters (for error messages)."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def decode_json_values(text: str, separators: str = " \n\t;,") -> tuple[list[Any], str]:
    """The JSON values written one after another at the start of ``text`` (between them only ``separators``),
    and the text left after the last one. Raises ``json.JSONDecodeError`` when the first value is not JSON."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos] in separators:
            pos += 1
        if pos >= len(text) or (values and text[pos] not in "{["):
            return values, text[pos:]
        value, pos = decoder.raw_decode(text, pos)
        values.append(value)


class ToolParser:
    """Base: ``parse(text) -> ParsedCalls``. Ids are ``call_id(id_prefix, i)``, ``i`` counting from ``first_index``
    over the calls (and malformed calls) in order of appearance.

    Facts a subclass sets (the server's streaming reads them, ``server/streaming.py``):
    ``call_open``: strings that open a call region anywhere in the reply; ``call_close``: the string that closes
    one region (None: a region runs to the end of the reply); ``opens_at_start``: a reply whose first non-space
    text starts with one of these is one call region to its end. Forced calls (``tool_choice`` ``required`` / a
    named tool) are ``forced_prefix`` + ``{"name": ..., <arguments_key>: {...}}`` + ``forced_suffix``
    (``forced_prefix`` None: the format is not JSON, so a call cannot be forced). ``example``: one call written
    in the format (what a parse error tells the model). ``template_markers``: strings any of which in a chat
    template marks this family (``detect_tool_parser``).
    """

    name = ""
    call_open: tuple[str, ...] = ()
    call_close: Optional[str] = None
    opens_at_start: tuple[str, ...] = ()
    forced_prefix: Optional[str] = None
    forced_suffix: str = ""
    arguments_key = "arguments"
    example = ""
    template_markers: tuple[str, ...] = ()
    refines: tuple[str, ...] = ()
    """Families this one is a special case of: when both match a template, this one is meant."""

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        """Calls, errors and leftover content of ``text``; ``tools`` (the request's schemas) type the values of
        formats that write them untyped (Qwen3-Coder XML)."""
        raise NotImplementedError

    def call_id(self, id_prefix: str, index: int, written: Any = None) -> str:
        """The id of call ``index``: ``{id_prefix}{index}`` (``written``, an id the model wrote, is ignored)."""
        return f"{id_prefix}{index}"


def format_parse_error(error: str, parser: Optional[ToolParser] = None) -> str:
    """The observation a malformed call turns into (how to write a call: ``parser.example``, Hermes by default)."""
    example = parser.example if parser is not None and parser.example else HERMES_EXAMPLE
    return f"Error: could not parse your tool call: {error}. Write each call as {example}."


HERMES_EXAMPLE = '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'


def to_openai_tool_calls(calls: list[ToolCall]) -> list[dict]:
    """OpenAI ``message.tool_calls`` entries (arguments as a JSON string)."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
        for c in calls
    ]
