"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}``, bare or after ``<|python_tag|>``.

The reply is a call when it starts with ``{`` (after leading space) or holds ``<|python_tag|>`` (the text before
the tag is content); several calls are JSON objects one after another, separated by ``;`` or whitespace. The
``<|python_tag|>`` token is special in Llama tokenizers, so a server that decodes with ``skip_special_tokens``
hands over the bare form, which parses the same. Built-in tool calls (``brave_search.call(query=...)``) are not
JSON and become parse errors.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolParser, call_from_object, decode_json_values, short

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Llama 3 JSON calls (``parameters`` holds the arguments)."""

    name = "llama3_json"
    call_open = (PYTHON_TAG,)
    opens_at_start = ("{",)
    forced_prefix = ""
    arguments_key = "parameters"
    example = '{"name": "<tool>", "parameters": {...}} as the whole reply'
    template_markers = (PYTHON_TAG, "<|start_header_id|>ipython")

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        tag = text.find(PYTHON_TAG)
        if tag >= 0:
            content, body = text[:tag].strip(), text[tag + len(PYTHON_TAG) :]
        elif text.lstrip().startswith("{"):
            content, body = "", text.lstrip()
        else:
            return ParsedCalls(content=text.strip())
        out = ParsedCalls()
        try:
            values, rest = decode_json_values(body)
        except json.JSONDecodeError as e:
            out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {short(body)}")
            out.content = content
            return out
        items: list[Any] = [i for v in values for i in (v if isinstance(v, list) else [v])]
        for item in items:
            call_id = self.call_id(id_prefix, first_index + len(out.calls) + len(out.errors))
            try:
                out.calls.append(call_from_object(item, call_id))
            except ValueError as e:
                out.errors.append(f"{e}: {short(json.dumps(item))}")
        out.content = "\n".join(p for p in (content, rest.strip()) if p)
        return out
