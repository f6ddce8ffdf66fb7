"""Plain JSON replies: the whole reply (optionally in a ```json fence) is one call object or a list of them."""

from __future__ import annotations

import json
import re
from typing import Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolParser, call_from_object, short

_FENCE_RE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.DOTALL)


class JsonToolParser(ToolParser):
    """The whole reply is a JSON object or list of objects; a reply not starting with ``{``/``[`` is plain content."""

    name = "json"
    opens_at_start = ("{", "[", "```")
    forced_prefix = ""
    example = 'one JSON object {"name": "<tool>", "arguments": {...}} (or a list of them) as the whole reply'

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
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
            out.errors.append(f"tool call is not valid JSON ({e.msg} at char {e.pos}): {short(body)}")
            return out
        for i, item in enumerate(obj if isinstance(obj, list) else [obj]):
            try:
                out.calls.append(call_from_object(item, self.call_id(id_prefix, first_index + i)))
            except ValueError as e:
                out.errors.append(f"{e}: {short(json.dumps(item))}")
        return out
