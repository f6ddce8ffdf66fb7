"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks anywhere in the text.

A trailing block without its closing tag (generation stopped on the ``</tool_call>`` stop string or ran out of
tokens) is parsed too.
"""

from __future__ import annotations

import json
import re
from typing import Optional

from training.openai_api.tool_parsers.base import (
    HERMES_EXAMPLE,
    ParsedCalls,
    ToolParser,
    call_from_object,
    short,
    split_blocks,
)

_BLOCK_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    """``<tool_call>{json}</tool_call>`` blocks (Qwen / Hermes)."""

    name = "hermes"
    call_open = ("<tool_call>",)
    call_close = "</tool_call>"
    forced_prefix = "<tool_call>\n"
    forced_suffix = "\n</tool_call>"
    example = HERMES_EXAMPLE
    template_markers = ("<tool_call>",)

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        content, bodies = split_blocks(_BLOCK_RE, text)
        out = ParsedCalls(content=content)
        for body in bodies:
            body = body.strip()
            call_id = self.call_id(id_prefix, first_index + len(out.calls) + len(out.errors))
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {short(body)}")
                continue
            try:
                out.calls.append(call_from_object(obj, call_id))
            except ValueError as e:
                out.errors.append(f"{e}: {short(body)}")
        return out
