"""OpenAI Responses API requests (``POST /v1/responses``) -> the chat-completions request they mean.

The deployment server and the training proxy serve the Responses API on top of their chat path: a request
is translated here into a chat body (rendered, constrained, sampled and recorded exactly like a chat
call), and the chat reply is translated back by ``responses_output.py`` (streamed: ``responses_stream.py``).
The subset is what the ``openai`` SDK's ``client.responses.create``, openai-agents (``OpenAIResponsesModel``)
and LangChain's Responses mode send:

| Responses request | chat completions |
| --- | --- |
| ``input``: a string | one ``user`` message |
| ``input`` item ``{"type": "message", "role", "content"}`` (``type`` optional; ``content`` a string or ``input_text`` / ``output_text`` parts) | a message of that role (``developer`` as ``system``) |
| ``input`` item ``function_call`` (``call_id``, ``name``, ``arguments``) | a ``tool_calls`` entry of the assistant message before it (a new one if none) |
| ``input`` item ``function_call_output`` (``call_id``, ``output``) | a ``tool`` message (``tool_call_id``) |
| ``instructions`` | a ``system`` message first (not carried over by ``previous_response_id``, as OpenAI) |
| ``previous_response_id`` | that response's conversation (its input and output, without its instructions) before ``input`` |
| ``tools`` of type ``function`` (flat: ``name``, ``description``, ``parameters``, ``strict``) | ``tools`` (``function.{name, description, parameters}``) |
| ``tool_choice`` ``auto`` / ``none`` / ``required`` / ``{"type": "function", "name"}`` | the same (``{"type": "function", "function": {"name"}}``) |
| ``text.format`` ``text`` / ``json_object`` / ``json_schema`` (``name``, ``schema``, ``strict``) | ``response_format`` |
| ``temperature``, ``top_p``, ``max_output_tokens``, ``parallel_tool_calls`` | ``temperature``, ``top_p``, ``max_tokens``, ``parallel_tool_calls`` |
| ``include: ["message.output_text.logprobs"]``, ``top_logprobs`` | ``logprobs: true``, ``top_logprobs`` |
| ``store``, ``metadata``, ``user``, ``service_tier``, ``prompt_cache_key``, ``safety_identifier`` | accepted (``store: false``: the response is not kept for ``previous_response_id``); ``user`` forwarded |
| ``stream`` | streamed events (``responses_stream.py``) |
| RL extras: ``return_token_ids``, ``seed`` | the same |

``strict`` on a function tool is accepted: a forced call (``tool_choice`` ``required`` or named) always
matches the schema (constrained decoding); a call the model makes on its own under ``auto`` is not
constrained, as on the chat route. Anything else is refused with ``ResponsesRequestError`` naming the field
(the servers answer 400): hosted tools, image / file / audio inputs, reasoning items, ``reasoning``,
``truncation: "auto"``, ``background``, ``conversation``, ``prompt``, ``max_tool_calls``, ``text.verbosity``,
``include`` entries other than logprobs and ``reasoning.encrypted_content`` (no reasoning is produced, so
there is none to include), and unknown fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

LOGPROBS_INCLUDE = "message.output_text.logprobs"
HARMLESS_INCLUDES = frozenset({LOGPROBS_INCLUDE, "reasoning.encrypted_content"})
"""``include`` entries honoured (logprobs) or trivially satisfied (no reasoning item is ever produced)."""
METADATA_FIELDS = frozenset(
    {"store", "metadata", "user", "service_tier", "prompt_cache_key", "safety_identifier", "prompt_cache_retention"}
)
HONOURED_FIELDS = frozenset(
    {"model", "input", "instructions", "previous_response_id", "tools", "tool_choice", "text", "temperature"}
    | {"top_p", "max_output_tokens", "parallel_tool_calls", "stream", "stream_options", "include", "top_logprobs"}
    | {"return_token_ids", "seed"}
)
_OFF_FIELDS = {
    # name: (is the value harmless?, what is not implemented)
    "reasoning": (lambda v: v is None or v == {} or all(x is None for x in v.values()), "reasoning effort / summaries"),
    "truncation": (lambda v: v in (None, "disabled"), "truncation 'auto' (the context is never cut to fit)"),
    "background": (lambda v: v in (None, False), "background responses"),
    "conversation": (lambda v: v is None, "conversations (use previous_response_id)"),
    "prompt": (lambda v: v is None, "prompt templates"),
    "max_tool_calls": (lambda v: v is None, "max_tool_calls"),
}
MAX_TOP_LOGPROBS = 20
CHAT_TO_RESPONSES_FIELDS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
"""A chat-side error's field -> the Responses field the client sent (the servers rename errors with it)."""


class ResponsesRequestError(ValueError):
    """A Responses request that cannot be served as asked; ``param`` names the field."""

    def __init__(self, param: str, message: str, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status


@dataclass
class ResponsesRequest:
    """A validated Responses request: what the chat body needs and what the response echoes."""

    input_messages: list[dict]
    """The chat messages of ``input`` (instructions and earlier responses not included)."""
    model: Optional[str] = None
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    tools: list[dict] = field(default_factory=list)
    """As sent (the Responses form), echoed on the response."""
    tool_choice: Any = "auto"
    """As sent (default ``auto``), echoed on the response."""
    text: dict = field(default_factory=lambda: {"format": {"type": "text"}})
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    max_output_tokens: Optional[int] = None
    parallel_tool_calls: bool = True
    store: bool = True
    metadata: dict = field(default_factory=dict)
    user: Optional[str] = None
    stream: bool = False
    logprobs: bool = False
    """``include`` has ``message.output_text.logprobs`` (or ``top_logprobs`` > 0): logprobs on the response."""
    top_logprobs: int = 0
    return_token_ids: bool = False
    seed: Optional[int] = None
    chat_tools: list[dict] = field(default_factory=list)
    chat_tool_choice: Any = None
    response_format: Optional[dict] = None

    def chat_messages(self, history: Optional[list[dict]] = None) -> list[dict]:
        """The whole conversation: instructions, then ``history`` (a previous response's), then ``input``."""
        head = [{"role": "system", "content": self.instructions}] if self.instructions else []
        return head + list(history or []) + self.input_messages

    def chat_body(self, history: Optional[list[dict]] = None) -> dict:
        """The chat-completions body this request means (``history``: the previous response's conversation)."""
        body: dict[str, Any] = {"messages": self.chat_messages(history)}
        if self.chat_tools:
            body["tools"] = self.chat_tools
        if self.chat_tool_choice is not None:
            body["tool_choice"] = self.chat_tool_choice
        if self.response_format is not None:
            body["response_format"] = self.response_format
        for key in ("temperature", "top_p", "seed", "user"):
            if getattr(self, key) is not None:
                body[key] = getattr(self, key)
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        if not self.parallel_tool_calls:
            body["parallel_tool_calls"] = False
        if self.logprobs:
            body["logprobs"] = True
            if self.top_logprobs:
                body["top_logprobs"] = self.top_logprobs
        if self.return_token_ids:
            body["return_token_ids"] = True
        return body


# ---------------------------------------------------------------- input items -> chat messages


def _text(content: Any, path: str, part_types: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ResponsesRequestError(path, f"'{path}' must be a string or a list of content parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types or not isinstance(part.get("text"), str):
            raise ResponsesRequestError(
                f"{path}[{j}]", f"'{path}[{j}]': only {' / '.join(part_types)} parts are supported, got {kind!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict, key: str, path: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ResponsesRequestError(f"{path}.{key}", f"'{path}.{key}' must be a non-empty string")
    return value


def input_messages(raw: Any) -> list[dict]:
    """``input`` (a string or a list of items) -> chat messages; ``function_call`` items join the assistant
    message before them (a run of output items is one assistant turn)."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise ResponsesRequestError("input", "'input' must be a string or a list of items")
    out: list[dict] = []
    open_assistant = False  # the last message is an assistant turn that later function_call items extend
    for i, item in enumerate(raw):
        path = f"input[{i}]"
        if isinstance(item, str):
            item = {"type": "message", "role": "user", "content": item}
        if not isinstance(item, dict):
            raise ResponsesRequestError(path, f"'{path}' must be an object or a string")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ResponsesRequestError(
                    f"{path}.role", f"'{path}.role' {role!r} is not user, system, developer or assistant"
                )
            parts = ("output_text", "input_text", "text") if role == "assistant" else ("input_text", "text")
            text = _text(item.get("content", ""), f"{path}.content", parts)
            out.append({"role": "system" if role == "developer" else role, "content": text})
            open_assistant = role == "assistant"
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", path),
                "type": "function",
                "function": {"name": _string(item, "name", path), "arguments": _string(item, "arguments", path)},
            }
            if not open_assistant:
                out.append({"role": "assistant", "content": ""})
                open_assistant = True
            out[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            text = (
                output
                if isinstance(output, str)
                else _text(output, f"{path}.output", ("input_text", "output_text", "text"))
            )
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", path), "content": text})
            open_assistant = False
        else:
            raise ResponsesRequestError(
                f"{path}.type",
                f"'{path}.type' {kind!r} is not supported: input items are messages, function_call and "
                "function_call_output (no reasoning, hosted-tool or reference items)",
            )
    return out


# ---------------------------------------------------------------- tools, tool_choice, text.format


def _tools(raw: Any) -> list[dict]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise ResponsesRequestError("tools", "'tools' must be a list")
    out = []
    for i, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ResponsesRequestError(
                f"tools[{i}].type",
                f"'tools[{i}].type' {kind!r} is not supported: only function tools are (no hosted tools)",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ResponsesRequestError(f"tools[{i}].name", f"'tools[{i}].name' must be a non-empty string")
        params = tool.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise ResponsesRequestError(
                f"tools[{i}].parameters", f"'tools[{i}].parameters' must be a JSON schema object"
            )
        fn: dict[str, Any] = {"name": name, "parameters": params or {"type": "object", "properties": {}}}
        if tool.get("description"):
            fn["description"] = str(tool["description"])
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ResponsesRequestError(
        "tool_choice",
        f"'tool_choice' must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}}, got {choice!r}",
    )


def _response_format(text: Any) -> Optional[dict]:
    if text is None:
        return None
    if not isinstance(text, dict):
        raise ResponsesRequestError("text", "'text' must be an object")
    for key, value in text.items():
        if key != "format" and value is not None:
            raise ResponsesRequestError(f"text.{key}", f"'text.{key}'={value!r} is not supported by this server")
    fmt = text.get("format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ResponsesRequestError("text.format.schema", "'text.format.schema' must be a JSON schema object")
        spec = {"name": fmt.get("name") or "response", "schema": fmt["schema"], "strict": bool(fmt.get("strict"))}
        return {"type": "json_schema", "json_schema": spec}
    raise ResponsesRequestError(
        "text.format", f"'text.format.type' must be text, json_object or json_schema, got {kind!r}"
    )


# ---------------------------------------------------------------- the request


def _typed(body: dict, name: str, types: tuple, what: str) -> Any:
    value = body.get(name)
    if value is not None and (not isinstance(value, types) or (isinstance(value, bool) and bool not in types)):
        raise ResponsesRequestError(name, f"'{name}' must be {what}, got {value!r}")
    return value


def _include(body: dict) -> bool:
    include = body.get("include") or []
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise ResponsesRequestError("include", "'include' must be a list of strings")
    for entry in include:
        if entry not in HARMLESS_INCLUDES:
            raise ResponsesRequestError(
                "include", f"'include' entry {entry!r} is not supported (only {LOGPROBS_INCLUDE!r})"
            )
    return LOGPROBS_INCLUDE in include


def _check_fields(body: dict) -> None:
    for name, value in body.items():
        if name in HONOURED_FIELDS or name in METADATA_FIELDS:
            continue
        if name in _OFF_FIELDS:
            harmless, what = _OFF_FIELDS[name]
            if harmless(value):
                continue
            raise ResponsesRequestError(
                name, f"'{name}'={value!r} is not supported by this server: {what} is not implemented"
            )
        raise ResponsesRequestError(
            name, f"unknown field '{name}': refused rather than ignored, since it could change what is generated"
        )


def parse_responses_request(body: Any) -> ResponsesRequest:
    """Validate a Responses request body (raises ``ResponsesRequestError`` naming the field)."""
    if not isinstance(body, dict):
        raise ResponsesRequestError("body", "the request body must be a JSON object")
    _check_fields(body)
    if "input" not in body:
        raise ResponsesRequestError("input", "'input' is required")
    stream = bool(_typed(body, "stream", (bool,), "a boolean"))
    if body.get("stream_options") is not None and not stream:
        raise ResponsesRequestError("stream_options", "'stream_options' is only allowed with 'stream': true")
    top = _typed(body, "top_logprobs", (int,), "an integer") or 0
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ResponsesRequestError("top_logprobs", f"'top_logprobs' must be in 0..{MAX_TOP_LOGPROBS}, got {top}")
    metadata = _typed(body, "metadata", (dict,), "an object") or {}
    prev = _typed(body, "previous_response_id", (str,), "a string")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        instructions = _text(instructions, "instructions", ("input_text", "text"))
    return ResponsesRequest(
        input_messages=input_messages(body["input"]),
        model=_typed(body, "model", (str,), "a string"),
        instructions=instructions or None,
        previous_response_id=prev or None,
        tools=list(body.get("tools") or []),
        tool_choice=body.get("tool_choice") or "auto",
        text=body.get("text") or {"format": {"type": "text"}},
        temperature=_typed(body, "temperature", (int, float), "a number"),
        top_p=_typed(body, "top_p", (int, float), "a number"),
        max_output_tokens=_typed(body, "max_output_tokens", (int,), "an integer"),
        parallel_tool_calls=_typed(body, "parallel_tool_calls", (bool,), "a boolean") is not False,
        store=_typed(body, "store", (bool,), "a boolean") is not False,
        metadata=dict(metadata),
        user=_typed(body, "user", (str,), "a string"),
        stream=stream,
        logprobs=_include(body) or top > 0,
        top_logprobs=top,
        return_token_ids=bool(_typed(body, "return_token_ids", (bool,), "a boolean")),
        seed=_typed(body, "seed", (int,), "an integer"),
        chat_tools=_tools(body.get("tools")),
        chat_tool_choice=_tool_choice(body.get("tool_choice")),
        response_format=_response_format(body.get("text")),
    )
