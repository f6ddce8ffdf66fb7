"""Anthropic Messages API (``POST /v1/messages``) on top of the proxy's chat path.

An agent written against the ``anthropic`` SDK points ``base_url`` at the proxy (the session
URL without ``/v1``: the SDK appends ``/v1/messages``). Its request is translated into a chat
completion request, forwarded and recorded exactly like one (same tokens, same NEW / APPEND /
WIPE matching on the translated messages), and the chat reply is translated back:

| Messages API | chat completions |
| --- | --- |
| ``system`` (text or text blocks) | a ``system`` message |
| ``text`` block | content text |
| assistant ``tool_use`` block (``id``, ``name``, ``input``) | ``tool_calls`` entry (``arguments`` = ``input``) |
| user ``tool_result`` block (``tool_use_id``, ``content``, ``is_error``) | ``tool`` message (``Error: `` if is_error) |
| ``tools`` (``name``, ``description``, ``input_schema``) | ``tools`` (``function.parameters``) |
| ``max_tokens``, ``stop_sequences`` (``stop``), ``temperature``, ``top_p``, ``top_k``, ``stream`` | same meaning |
| ``tool_choice`` ``auto`` / ``any`` / ``tool`` (``name``) / ``none`` | ``auto`` / ``required`` / named function / ``none`` |
| ``tool_choice.disable_parallel_tool_use: true`` | ``parallel_tool_calls: false`` |
| ``stop_reason`` ``end_turn`` / ``max_tokens`` / ``tool_use`` | ``finish_reason`` ``stop``/``length``/``tool_calls`` |

The translated body then meets the proxy's sampling policy like any chat call (``sampling_policy.py``:
``top_k`` is refused, a forced ``tool_choice`` is recorded as constrained). Refused with a 400 naming
the field: image and document blocks, ``thinking`` blocks sent back, ``thinking`` enabled (no thinking
budget is implemented; ``{"type": "disabled"}`` is accepted), and any top-level field not listed here.
``metadata`` is accepted and not forwarded (it never changes the tokens). Streaming is synthesised from the full reply
(``message_start``, one content block per text / tool call with its delta, ``message_delta``,
``message_stop``).
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Optional

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "abort": "end_turn"}


class AnthropicRequestError(ValueError):
    """A request the translation refuses; ``param`` names the field."""

    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def error_body(message: str, err_type: str = "invalid_request_error") -> dict:
    """Anthropic's error envelope."""
    return {"type": "error", "error": {"type": err_type, "message": message}}


def _text(content: Any, path: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise AnthropicRequestError(path, f"must be a string or a list of blocks, got {type(content).__name__}")
    parts = []
    for j, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise AnthropicRequestError(f"{path}[{j}]", f"only text blocks are supported here, got {kind!r}")
        parts.append(block["text"])
    return "".join(parts)


def _message(i: int, m: Any) -> list[dict]:
    """One Messages-API message -> chat messages (tool results become ``tool`` messages, in order)."""
    path = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
        raise AnthropicRequestError(f"{path}.role", "must be 'user' or 'assistant'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise AnthropicRequestError(f"{path}.content", "must be a string or a list of content blocks")
    out: list[dict] = []
    text: list[str] = []
    calls: list[dict] = []
    for j, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        bpath = f"{path}.content[{j}]"
        if kind == "text":
            text.append(str(block.get("text", "")))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("name"), str):
                raise AnthropicRequestError(f"{bpath}.name", "must be a string")
            calls.append(
                {
                    "id": str(block.get("id") or ""),
                    "type": "function",
                    "function": {"name": block["name"], "arguments": block.get("input") or {}},
                }
            )
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            result = _text(result, f"{bpath}.content") if result is not None else ""
            if block.get("is_error"):
                result = f"Error: {result}"
            out.append({"role": "tool", "tool_call_id": str(block.get("tool_use_id") or ""), "content": result})
        else:
            raise AnthropicRequestError(bpath, f"block type {kind!r} is not supported for role {role!r}")
    if role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(text)}
        if calls:
            msg["tool_calls"] = calls
        return [msg]
    if text or not out:
        out.append({"role": "user", "content": "".join(text)})
    return out


def to_chat_request(body: Any) -> dict:
    """A Messages-API request body -> a chat-completions body (raises ``AnthropicRequestError``)."""
    if not isinstance(body, dict):
        raise AnthropicRequestError("body", "must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise AnthropicRequestError("messages", "must be a non-empty list")
    max_tokens = body.get("max_tokens")
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise AnthropicRequestError("max_tokens", "is required: a positive integer")
    chat: list[dict] = []
    if body.get("system"):
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        chat += _message(i, m)
    out: dict[str, Any] = {"messages": chat, "max_tokens": max_tokens, "stream": bool(body.get("stream"))}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]
    if body.get("stop_sequences"):
        out["stop"] = list(body["stop_sequences"])
    for key in ("temperature", "top_p", "top_k"):
        if body.get(key) is not None:
            out[key] = body[key]
    _check_fields(body)
    choice = _tool_choice(body.get("tool_choice"))
    out.update(choice)
    tools = body.get("tools")
    if tools:
        if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("name"), str) for t in tools
        ):
            raise AnthropicRequestError("tools", "must be a list of objects with a 'name'")
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t["name"],
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or {"type": "object", "properties": {}},
                },
            }
            for t in tools
        ]
    return out


KNOWN_FIELDS = frozenset(
    {"model", "messages", "system", "max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k"}
    | {"tools", "tool_choice", "thinking", "metadata"}
)
"""Top-level Messages-API fields the translation maps (or, ``metadata``, accepts as metadata)."""


def _check_fields(body: dict) -> None:
    """400 for a field that would otherwise be silently ignored: unknown fields and enabled ``thinking``."""
    for name in body:
        if name not in KNOWN_FIELDS:
            raise AnthropicRequestError(name, "is not supported by the training proxy (refused rather than ignored)")
    thinking = body.get("thinking")
    if thinking is not None and thinking != {"type": "disabled"}:
        raise AnthropicRequestError(
            "thinking",
            f"{thinking!r} is not supported: the served model has no thinking budget to honour; "
            "omit it or send {'type': 'disabled'}",
        )


def _tool_choice(choice: Any) -> dict:
    """Anthropic ``tool_choice`` -> the chat fields it means (``tool_choice``, ``parallel_tool_calls``)."""
    if choice is None:
        return {}
    kind = choice.get("type") if isinstance(choice, dict) else None
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if kind == "tool":
        if not isinstance(choice.get("name"), str) or not choice["name"]:
            raise AnthropicRequestError("tool_choice.name", "is required for type 'tool'")
        mapped = {"type": "function", "function": {"name": choice["name"]}}
    if mapped is None:
        raise AnthropicRequestError(
            "tool_choice", f"must be an object with type auto, any, tool or none, got {choice!r}"
        )
    out: dict[str, Any] = {"tool_choice": mapped}
    if choice.get("disable_parallel_tool_use"):
        out["parallel_tool_calls"] = False
    return out


def _arguments(arguments: Any) -> dict:
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return {"_raw": arguments}
        return value if isinstance(value, dict) else {"_value": value}
    return arguments or {}


def from_chat_response(reply: dict, model: Optional[str]) -> dict:
    """A chat-completion reply (one choice) -> a Messages-API ``message``."""
    choice = reply["choices"][0]
    msg = choice.get("message") or {}
    content: list[dict] = []
    if msg.get("content"):
        content.append({"type": "text", "text": msg["content"]})
    for c in msg.get("tool_calls") or []:
        fn = c.get("function") or {}
        content.append(
            {
                "type": "tool_use",
                "id": c.get("id") or f"toolu_{uuid.uuid4().hex[:20]}",
                "name": fn.get("name", ""),
                "input": _arguments(fn.get("arguments")),
            }
        )
    usage = reply.get("usage") or {}
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model or reply.get("model", ""),
        "content": content,
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": int(usage.get("prompt_tokens", 0)),
            "output_tokens": int(usage.get("completion_tokens", 0)),
        },
    }


def stream_events(message: dict) -> list[tuple[str, dict]]:
    """The ``(event, data)`` pairs of a Messages-API stream that delivers ``message``."""
    start = dict(message, content=[], stop_reason=None, usage={**message["usage"], "output_tokens": 0})
    events: list[tuple[str, dict]] = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            first, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            first = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            delta = {"type": "input_json_delta", "partial_json": json.dumps(block["input"])}
        events += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": first}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    events += [
        (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        ),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events
