"""Request fields that constrain the output: ``tool_choice`` and ``response_format`` -> an engine ``Constraint``.

- ``tool_choice``: ``"auto"`` (default when ``tools`` are given) and ``"none"`` only say whether tool calls are
  parsed. ``"required"`` or a named tool (``{"type": "function", "function": {"name": X}}``) constrain the
  output to one tool call in the format of the server's tool-call parser (``parser.forced_prefix`` +
  ``{"name": ..., <parser.arguments_key>: {...}}`` + ``parser.forced_suffix``; Hermes / Qwen by default,
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), whose arguments match that tool's
  ``parameters`` schema (any of the tools for ``"required"``, the named one otherwise); the reply is parsed into
  ``tool_calls`` as usual. A parser whose format is not JSON (``forced_prefix`` None: Qwen3-Coder XML, Gemma
  ``tool_code``) cannot be forced: a 400 names it.
- ``response_format`` (chat and completions): ``{"type": "text"}`` (default) is free text; ``{"type": "json_object"}`` is one JSON
  object; ``{"type": "json_schema", "json_schema": {"schema": {...}}}`` is JSON matching the schema
  (``strict`` or not: the output always matches).

With a forced tool call and a JSON response format together, the reply is the forced call (the format
governs text replies, as on OpenAI). ``/v1/completions`` takes the same
fields (``completion_constraint``): its prompt is the caller's, so ``tools`` only give a forced call's grammar. Raises :class:`StructuredOutputError`
(the message and the field), which the request parser turns into a 400.
"""

from __future__ import annotations

from typing import Any, Optional

from training.deployment.engine.constraints import Constraint, check_constraint
from training.openai_api.tool_parsers import HermesToolParser, ToolParser

TOOL_CALL_PREFIX = HermesToolParser.forced_prefix
TOOL_CALL_SUFFIX = HermesToolParser.forced_suffix
"""The Hermes / Qwen wrapper of one call, as the chat templates write it and ``HermesToolParser`` reads it."""


class StructuredOutputError(ValueError):
    """A ``tool_choice`` / ``response_format`` that cannot be served; ``param`` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _tool_name(tool: Any, i: int) -> str:
    fn = tool.get("function") if isinstance(tool, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or not name:
        raise StructuredOutputError(f"'tools'[{i}] needs 'function': {{'name': ...}} to force a tool call", "tools")
    return name


def _call_schema(tool: dict, arguments_key: str = "arguments") -> dict:
    """A ``{"name": <this tool>, <arguments_key>: <its parameters>}`` object."""
    params = tool["function"].get("parameters")
    if params is None:
        params = {"type": "object"}
    if not isinstance(params, dict):
        raise StructuredOutputError(f"the parameters of tool {tool['function']['name']!r} must be an object", "tools")
    return {
        "type": "object",
        "properties": {"name": {"const": tool["function"]["name"]}, arguments_key: params},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def tool_choice(
    body: dict, tools: Optional[list[dict]], parser: Optional[ToolParser] = None
) -> tuple[bool, Optional[Constraint]]:
    """(whether tool calls are parsed, the constraint that forces one in ``parser``'s format, or None)."""
    choice = body.get("tool_choice")
    if choice is None or choice == "auto":
        return bool(tools), None
    if choice == "none":
        return False, None
    if choice == "required":
        if not tools:
            raise StructuredOutputError("'tool_choice': 'required' needs a non-empty 'tools' list", "tool_choice")
        for i, t in enumerate(tools):
            _tool_name(t, i)
        chosen = tools
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str):
            raise StructuredOutputError(
                f"'tool_choice' object must be {{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}",
                "tool_choice",
            )
        chosen = [t for i, t in enumerate(tools or []) if _tool_name(t, i) == name]
        if not chosen:
            raise StructuredOutputError(f"'tool_choice' names {name!r}, which is not in 'tools'", "tool_choice")
        chosen = chosen[:1]
    else:
        raise StructuredOutputError(
            f"'tool_choice' must be 'auto', 'none', 'required' or an object, got {choice!r}", "tool_choice"
        )
    parser = parser or HermesToolParser()
    if parser.forced_prefix is None:
        raise StructuredOutputError(
            f"'tool_choice': {choice!r} cannot be forced with tool_call_parser {parser.name!r}: its calls are not "
            "JSON, so no grammar writes them; send 'auto', or serve with a JSON tool_call_parser",
            "tool_choice",
        )
    schemas = [_call_schema(t, parser.arguments_key) for t in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    return True, _checked(Constraint(schema, parser.forced_prefix, parser.forced_suffix), "tool_choice")


def response_format(body: dict) -> Optional[Constraint]:
    """The constraint of ``response_format`` (None for text)."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return _checked(Constraint({"type": "object"}), "response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise StructuredOutputError(
                "'response_format' json_schema needs 'json_schema': {'schema': {...}} (a JSON schema object)",
                "response_format",
            )
        return _checked(Constraint(schema), "response_format")
    raise StructuredOutputError(
        f"'response_format' must be {{'type': 'text' | 'json_object' | 'json_schema'}}, got {fmt!r}", "response_format"
    )


def chat_constraint(
    body: dict, tools: Optional[list[dict]], parser: Optional[ToolParser] = None
) -> tuple[bool, Optional[Constraint]]:
    """(whether tool calls are parsed, the output constraint) of a chat request.

    A forced tool call and a JSON ``response_format`` together (what openai-agents sends for an agent with an
    ``output_type`` and a forced ``tool_choice``) mean what they mean on OpenAI: this reply is the forced
    call, and the format governs a text reply, which a forced call's reply has none of; so the call's grammar
    is the constraint (the format is still checked)."""
    parse_calls, forced = tool_choice(body, tools, parser)
    fmt = response_format(body)
    return parse_calls, forced or fmt


def completion_constraint(body: dict, parser: Optional[ToolParser] = None) -> Optional[Constraint]:
    """The output constraint of a /v1/completions request: ``response_format``, or a forced ``tool_choice``.

    The prompt of a completion is the caller's own (token ids or text, tools already rendered by an in-process
    agent), so ``tools`` there only give a forced call's grammar: they are refused unless ``tool_choice`` is
    ``"required"`` or a named tool (else they would be silently ignored)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None and choice is None:
        return response_format(body)
    if choice in (None, "auto", "none"):
        raise StructuredOutputError(
            "'tools' on /v1/completions only give a forced call's grammar ('tool_choice' 'required' or a named "
            "tool): a completion's prompt is the caller's, so tools are never rendered into it",
            "tools" if tools is not None else "tool_choice",
        )
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise StructuredOutputError("'tools' must be a list of objects", "tools")
    return chat_constraint(body, tools, parser)[1]


def _checked(constraint: Constraint, param: str) -> Constraint:
    problem = check_constraint(constraint)
    if problem is not None:
        raise StructuredOutputError(f"'{param}': {problem}", param)
    return constraint
