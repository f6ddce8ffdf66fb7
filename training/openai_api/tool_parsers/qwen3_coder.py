"""Qwen3-Coder XML tool calls: ``<tool_call><function=NAME><parameter=P>VALUE</parameter>...</function></tool_call>``.

The template writes a newline after each opening tag and before each closing one; one is stripped on each side
of a value. Values are written untyped (strings raw, the rest as JSON or Python text), so the request's tool
schemas type them: a ``string`` parameter keeps the raw text; ``integer`` / ``number`` / ``boolean`` are
converted (``True`` / ``true`` both read); ``object`` / ``array`` and parameters without a schema are read as
JSON, then as a Python literal (``ast.literal_eval``, which evaluates nothing), else kept as text. A value that
does not convert to its declared type stays text. A trailing block without ``</tool_call>`` (or a missing
``</function>`` / ``</parameter>``) is parsed too.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolCall, ToolParser, short, split_blocks

_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FUNCTION_RE = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


def _param_types(tools: Optional[list[dict]], name: str) -> dict[str, Any]:
    """``{parameter: JSON-schema type}`` of tool ``name`` in ``tools`` (empty when it is not there)."""
    for tool in tools or []:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        if isinstance(fn, dict) and fn.get("name") == name:
            props = (fn.get("parameters") or {}).get("properties") or {}
            return {k: v.get("type") for k, v in props.items() if isinstance(v, dict)}
    return {}


def _loose(value: str) -> Any:
    """JSON, else a Python literal, else the text."""
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return value


def typed_value(value: str, kind: Any) -> Any:
    """``value`` as the schema type ``kind`` says (see the module docstring); text when it does not convert."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if "string" in kinds:
        return value
    text = value.strip()
    if kinds & {"integer", "number"}:
        try:
            number = float(text)
        except ValueError:
            return value
        return int(number) if number.is_integer() and ("integer" in kinds or re.fullmatch(r"-?\d+", text)) else number
    if "boolean" in kinds:
        return {"true": True, "false": False}.get(text.lower(), value)
    if "null" in kinds and text.lower() in ("null", "none"):
        return None
    return _loose(text)


class Qwen3CoderToolParser(ToolParser):
    """``<tool_call><function=...>`` XML blocks (Qwen3-Coder)."""

    name = "qwen3_coder"
    call_open = ("<tool_call>",)
    call_close = "</tool_call>"
    example = "<tool_call>\n<function=TOOL>\n<parameter=NAME>\nVALUE\n</parameter>\n</function>\n</tool_call>"
    template_markers = ("<function=", "<parameter=")
    refines = ("hermes",)
    """Qwen3-Coder templates also write ``<tool_call>``: when both match, this family is the one meant."""

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        content, bodies = split_blocks(_BLOCK_RE, text)
        out = ParsedCalls(content=content)
        for body in bodies:
            fn = _FUNCTION_RE.search(body)
            call_id = self.call_id(id_prefix, first_index + len(out.calls) + len(out.errors))
            if fn is None or not fn.group(1).strip():
                out.errors.append(f"a tool call needs <function=NAME>: {short(body)}")
                continue
            name = fn.group(1).strip()
            types = _param_types(tools, name)
            args = {}
            for p in _PARAM_RE.finditer(fn.group(2)):
                value = p.group(2)
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                args[p.group(1).strip()] = typed_value(value, types.get(p.group(1).strip()))
            out.calls.append(ToolCall(id=call_id, name=name, arguments=args))
        return out
