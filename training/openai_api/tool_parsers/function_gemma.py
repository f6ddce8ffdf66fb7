"""FunctionGemma (Gemini-style) calls: ``<start_function_call>call:NAME{key:VALUE,...}<end_function_call>``.

Values are written in FunctionGemma's own notation: strings between ``<escape>`` delimiters
(``city:<escape>Oslo<escape>``), objects ``{key:value,...}`` with bare keys, lists ``[value,...]``, and bare
numbers, ``true`` / ``false`` / ``null``. A bare value that is none of these is read as text.

The markers and ``<escape>`` are special tokens in FunctionGemma's tokenizer, so a server that decodes with
``skip_special_tokens`` hands over ``call:NAME{city:Oslo}``: a reply that starts with ``call:`` is read the same
way, its unescaped strings ending at the next ``,``, ``}`` or ``]`` (so such a string cannot hold those).
Text outside the calls is content; a trailing call without ``<end_function_call>`` is parsed too.
"""

from __future__ import annotations

import re
from typing import Any, Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolCall, ToolParser, short, split_blocks

CALL_OPEN, CALL_CLOSE, ESCAPE = "<start_function_call>", "<end_function_call>", "<escape>"
_CALL_RE = re.compile(r"<start_function_call>(.*?)(?:<end_function_call>|$)", re.DOTALL)
_NAME_RE = re.compile(r"\s*call:([\w.\-]+)\s*\{")
_BARE = {"true": True, "false": False, "null": None}


class _Reader:
    """A cursor over one call's argument text; each ``read_*`` raises ValueError naming what is wrong."""

    def __init__(self, text: str, pos: int):
        self.text, self.pos = text, pos

    def value(self) -> Any:
        t = self.text
        if t.startswith(ESCAPE, self.pos):
            end = t.find(ESCAPE, self.pos + len(ESCAPE))
            if end < 0:
                raise ValueError("a string has no closing <escape>")
            value, self.pos = t[self.pos + len(ESCAPE) : end], end + len(ESCAPE)
            return value
        if t.startswith("{", self.pos):
            return self.mapping()
        if t.startswith("[", self.pos):
            self.pos += 1
            items = []
            while not self._take("]"):
                items.append(self.value())
                if not self._take(","):
                    self._expect("]")
                    break
            return items
        m = re.compile(r"[^,}\]]*").match(t, self.pos)
        self.pos = m.end()
        token = m.group(0).strip()
        if token in _BARE:
            return _BARE[token]
        try:
            return int(token)
        except ValueError:
            pass
        try:
            return float(token)
        except ValueError:
            return token

    def mapping(self) -> dict:
        """``{key:value,...}`` at the cursor."""
        self._expect("{")
        out = {}
        while not self._take("}"):
            colon = self.text.find(":", self.pos)
            if colon < 0:
                raise ValueError("an argument has no ':'")
            key = self.text[self.pos : colon].strip()
            if not key or any(c in key for c in "{}[],"):
                raise ValueError(f"{key!r} is not an argument name")
            self.pos = colon + 1
            out[key] = self.value()
            if not self._take(","):
                self._expect("}")
                break
        return out

    def _take(self, char: str) -> bool:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1
        if self.text.startswith(char, self.pos):
            self.pos += 1
            return True
        return False

    def _expect(self, char: str) -> None:
        if not self._take(char):
            raise ValueError(f"expected {char!r} at char {self.pos}")


def _call(body: str, call_id: str) -> ToolCall:
    m = _NAME_RE.match(body)
    if m is None:
        raise ValueError("a call must be written call:NAME{...}")
    reader = _Reader(body, m.end() - 1)
    return ToolCall(id=call_id, name=m.group(1), arguments=reader.mapping())


class FunctionGemmaToolParser(ToolParser):
    """``<start_function_call>call:NAME{...}<end_function_call>`` (FunctionGemma)."""

    name = "functiongemma"
    call_open = (CALL_OPEN,)
    call_close = CALL_CLOSE
    opens_at_start = ("call:",)
    example = "<start_function_call>call:<tool>{name:<escape>value<escape>,count:1}<end_function_call>"
    template_markers = (CALL_OPEN,)

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        if CALL_OPEN not in text and text.lstrip().startswith("call:"):
            content, bodies = "", [text.strip()]
        else:
            content, bodies = split_blocks(_CALL_RE, text)
        out = ParsedCalls(content=content)
        for body in bodies:
            try:
                out.calls.append(_call(body, self.call_id(id_prefix, first_index + len(out.calls) + len(out.errors))))
            except ValueError as e:
                out.errors.append(f"{e}: {short(body)}")
        return out
