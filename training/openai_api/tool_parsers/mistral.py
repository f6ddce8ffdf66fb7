"""Mistral tool calls: ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": "abc123XYZ"}, ...]``.

Also read: the newer ``[TOOL_CALLS]name[ARGS]{...}`` form (one marker per call), and a reply that starts with
``[{`` (``[TOOL_CALLS]`` is a special token in Mistral tokenizers, so a server that decodes with
``skip_special_tokens`` hands over the bare list). Text before the first marker is content.

Ids: Mistral's chat templates refuse a tool-call id that is not 9 alphanumeric characters, so the id the model
wrote is kept when it is one, and otherwise an id of that shape is derived from the prefix and index
(the first 9 hex digits of their SHA-256: deterministic, and distinct for distinct prefixes).
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolParser, call_from_object, decode_json_values, short

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_ID_RE = re.compile(r"[A-Za-z0-9]{9}")


class MistralToolParser(ToolParser):
    """``[TOOL_CALLS]`` followed by a JSON list of calls (or ``name[ARGS]{json}``)."""

    name = "mistral"
    call_open = (TOOL_CALLS,)
    opens_at_start = ("[{",)
    forced_prefix = TOOL_CALLS + "["
    forced_suffix = "]"
    example = '[TOOL_CALLS][{"name": "<tool>", "arguments": {...}}]'
    template_markers = (TOOL_CALLS,)

    def call_id(self, id_prefix: str, index: int, written: Any = None) -> str:
        """The model's own id when it is 9 alphanumerics, else 9 hex digits of sha256(``{id_prefix}{index}``)."""
        if isinstance(written, str) and _ID_RE.fullmatch(written):
            return written
        return hashlib.sha256(f"{id_prefix}{index}".encode()).hexdigest()[:9]

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        marker = text.find(TOOL_CALLS)
        if marker < 0:
            if not text.lstrip().startswith("[{"):
                return ParsedCalls(content=text.strip())
            bare = self._segments([text.lstrip()], id_prefix, first_index)
            return bare if bare.calls and not bare.errors else ParsedCalls(content=text.strip())
        segments = text[marker + len(TOOL_CALLS) :].split(TOOL_CALLS)
        out = self._segments(segments, id_prefix, first_index)
        out.content = "\n".join(p for p in (text[:marker].strip(), out.content) if p)
        return out

    def _segments(self, segments: list[str], id_prefix: str, first_index: int) -> ParsedCalls:
        """The calls of each text after a ``[TOOL_CALLS]`` marker; text after the last call is content."""
        out, rests = ParsedCalls(), []
        for seg in segments:
            body = seg.strip()
            items: list[Any] = []
            if body.startswith(("[", "{")):
                try:
                    values, rest = decode_json_values(body)
                except json.JSONDecodeError as e:
                    out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {short(body)}")
                    continue
                items = [i for v in values for i in (v if isinstance(v, list) else [v])]
            elif ARGS in body:
                name, args = body.split(ARGS, 1)
                try:
                    values, rest = decode_json_values(args)
                except json.JSONDecodeError as e:
                    out.errors.append(f"arguments are not valid JSON ({e.msg} at char {e.pos}): {short(body)}")
                    continue
                items = [{"name": name.strip(), "arguments": values[0] if values else {}}]
            else:
                out.errors.append(
                    f"expected a JSON list of calls or name[ARGS]{{...}} after {TOOL_CALLS}: {short(body)}"
                )
                continue
            for item in items:
                index = first_index + len(out.calls) + len(out.errors)
                written = item.get("id") if isinstance(item, dict) else None
                try:
                    out.calls.append(call_from_object(item, self.call_id(id_prefix, index, written)))
                except ValueError as e:
                    out.errors.append(f"{e}: {short(json.dumps(item))}")
            rests.append(rest.strip())
        out.content = "\n".join(r for r in rests if r)
        return out
