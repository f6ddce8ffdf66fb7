"""OpenAI-shaped chat histories -> the plain form chat templates render.

Agents written against the OpenAI SDK send histories that Hugging Face chat templates do not
expect: an assistant reply that was only a tool call comes back with ``content: None`` or no
``content`` at all (``message.model_dump(exclude_none=True)``), tool-call ``arguments`` are
JSON strings, content may be a list of parts, and the SDK adds ``None`` fields. A template
that reads ``message['content']`` then fails (SmolLM2's does), and one that writes
``arguments | tojson`` double-encodes a string. ``normalise_messages`` fixes all of this once,
for the inference server (``deployment/server/protocol.py``), the training proxy's turn matching and
the template check, so all three see the same conversation:

- ``role`` must be ``system``, ``developer``, ``user``, ``assistant`` or ``tool``;
  ``developer`` becomes ``system`` (what chat templates know).
- ``content``: a string; a list of text parts (``text`` / ``input_text`` / ``output_text``)
  is joined; ``None`` or missing is ``""`` for an assistant message (required otherwise).
- ``tool_calls`` (assistant only): each becomes
  ``{"id", "type": "function", "function": {"name", "arguments": <object>}}``; arguments
  given as a JSON string are decoded (``""`` is ``{}``); a flat ``{"name", "arguments"}`` is
  accepted. An empty list is dropped.
- ``tool`` messages keep ``tool_call_id``; a missing ``name`` is filled from the assistant
  call with that id (``normalise_messages`` only).
- ``None`` values and empty ``annotations`` are dropped; other keys are kept as given.

Templates that ignore ``tool_calls`` (SmolLM2's renders only ``content``) would drop the
call from the history, so the model would see a tool result without the call it made.
``prepare_for_template`` detects such templates (``template_renders_tool_calls``) and writes
the calls into the content in the Hermes format the server's tool parser reads back:
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` (``assistant_text``).

Bad input raises ``ChatMessageError`` (a ``ValueError``) whose ``path`` names the field,
e.g. ``messages[3].tool_calls[0].function.arguments``. Pure Python: the tokenizer is any
object with ``apply_chat_template`` and a ``chat_template`` attribute.
"""

from __future__ import annotations

import json
from typing import Any, Optional

ROLES = ("system", "developer", "user", "assistant", "tool")
"""Roles a message may have."""
TEXT_PART_TYPES = ("text", "input_text", "output_text")
"""Content-part types whose ``text`` is kept (images and audio are refused)."""
_SDK_EMPTY_KEYS = ("annotations",)
"""Keys the OpenAI SDK fills with an empty list that no template reads."""
_PROBE_TOOL_NAME = "probe_tool_6d1f2a"


class ChatMessageError(ValueError):
    """A message that cannot be normalised; ``path`` names the field (``messages[2].content``)."""

    def __init__(self, path: str, message: str):
        super().__init__(f"{path}: {message}")
        self.path = path
        self.detail = message


def content_text(content: Any, path: str) -> str:
    """``content`` as one string: a string as is, text parts joined; raises for other parts or types."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
                raise ChatMessageError(f"{path}[{j}]", f"only text parts are supported, got type {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise ChatMessageError(path, f"must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(arguments: Any, path: str) -> dict:
    if arguments is None:
        return {}
    if isinstance(arguments, str):
        if not arguments.strip():
            return {}
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as e:
            raise ChatMessageError(path, f"a string that is not JSON ({e.msg} at char {e.pos})") from None
    if not isinstance(arguments, dict):
        raise ChatMessageError(path, f"must be a JSON object, got {type(arguments).__name__}")
    return arguments


def normalise_tool_call(call: Any, path: str) -> dict:
    """One OpenAI tool call as ``{"id", "type": "function", "function": {"name", "arguments": dict}}``."""
    if not isinstance(call, dict):
        raise ChatMessageError(path, f"must be an object, got {type(call).__name__}")
    fn = call.get("function") if "function" in call else call  # flat {"name", "arguments"} too
    if not isinstance(fn, dict):
        raise ChatMessageError(f"{path}.function", f"must be an object, got {type(fn).__name__}")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ChatMessageError(f"{path}.function.name", "must be a non-empty string")
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": name, "arguments": _arguments(fn.get("arguments"), f"{path}.function.arguments")},
    }
    if call.get("id") is not None:
        out = {"id": str(call["id"]), **out}
    return out


def normalise_message(message: Any, index: int = 0) -> dict:
    """One message in template form (see the module docstring); ``index`` only names it in errors."""
    path = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ChatMessageError(path, f"must be an object, got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ChatMessageError(f"{path}.role", f"{role!r} is not one of {', '.join(ROLES)}")
    out = {k: v for k, v in message.items() if v is not None and not (k in _SDK_EMPTY_KEYS and v == [])}
    out["role"] = "system" if role == "developer" else role
    content = message.get("content")
    if content is None and role != "assistant":
        raise ChatMessageError(f"{path}.content", f"is required for role {role!r}")
    out["content"] = "" if content is None else content_text(content, f"{path}.content")
    calls = out.pop("tool_calls", None)
    if calls:
        if role != "assistant":
            raise ChatMessageError(f"{path}.tool_calls", f"only assistant messages carry tool calls, not {role!r}")
        if not isinstance(calls, list):
            raise ChatMessageError(f"{path}.tool_calls", f"must be a list, got {type(calls).__name__}")
        out["tool_calls"] = [normalise_tool_call(c, f"{path}.tool_calls[{j}]") for j, c in enumerate(calls)]
    if "reasoning_content" in out and not isinstance(out["reasoning_content"], str):
        raise ChatMessageError(f"{path}.reasoning_content", "must be a string")
    return out


def normalise_messages(messages: Any) -> list[dict]:
    """Every message normalised; tool messages without ``name`` get their call's function name."""
    if not isinstance(messages, list):
        raise ChatMessageError("messages", f"must be a list, got {type(messages).__name__}")
    out = [normalise_message(m, i) for i, m in enumerate(messages)]
    names: dict[str, str] = {}
    for m in out:
        for call in m.get("tool_calls", ()):
            if "id" in call:
                names[call["id"]] = call["function"]["name"]
        if m["role"] == "tool" and "name" not in m and m.get("tool_call_id") in names:
            m["name"] = names[m["tool_call_id"]]
    return out


def tool_call_text(call: dict) -> str:
    """A normalised call in the Hermes format: ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>``."""
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def assistant_text(message: dict) -> str:
    """A normalised assistant message as the model writes it: content, then each call's block on its own line."""
    text = message.get("content") or ""
    for call in message.get("tool_calls", ()):
        text += ("\n" if text else "") + tool_call_text(call)
    return text


def inline_tool_calls(messages: list[dict]) -> list[dict]:
    """Normalised messages with every assistant's ``tool_calls`` written into its content (``assistant_text``)."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            text = assistant_text(m)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = text
        out.append(m)
    return out


_RENDERS_TOOL_CALLS: dict[str, bool] = {}


def template_renders_tool_calls(tokenizer: Any) -> bool:
    """True if the tokenizer's chat template writes an assistant message's ``tool_calls`` (cached per template).

    A template that raises on the probe counts as not rendering them.
    """
    template = getattr(tokenizer, "chat_template", None)
    key = template if isinstance(template, str) else repr(template)
    if key not in _RENDERS_TOOL_CALLS:
        probe = [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "call_0", "type": "function", "function": {"name": _PROBE_TOOL_NAME, "arguments": {}}}
                ],
            },
        ]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that cannot take tool calls does not render them
            text = ""
        _RENDERS_TOOL_CALLS[key] = _PROBE_TOOL_NAME in str(text)
    return _RENDERS_TOOL_CALLS[key]


def prepare_for_template(messages: Any, tokenizer: Optional[Any] = None) -> list[dict]:
    """``normalise_messages``, then ``inline_tool_calls`` when ``tokenizer``'s template ignores ``tool_calls``."""
    out = normalise_messages(messages)
    if tokenizer is not None and any(m.get("tool_calls") for m in out) and not template_renders_tool_calls(tokenizer):
        out = inline_tool_calls(out)
    return out


__all__ = [
    "ROLES",
    "ChatMessageError",
    "assistant_text",
    "content_text",
    "inline_tool_calls",
    "normalise_message",
    "normalise_messages",
    "normalise_tool_call",
    "prepare_for_template",
    "template_renders_tool_calls",
    "tool_call_text",
]
