"""Gemma ``tool_code`` calls: a fenced block of Python call expressions, as Google's Gemma function-calling guide
shows::

    ```tool_code
    get_weather(city="Oslo", days=3)
    ```

A block may hold several calls (one per line, or one list ``[f(a=1), g(b=2)]``); ``print(f(...))`` reads as
``f(...)``. The bare list that Google's Gemma 3 function-calling prompt asks for, a whole reply
``[f(a=1), g(b=2)]`` with no fence, is read too (a reply in brackets that is not a list of calls is content). Arguments must be keyword arguments whose values are literals (strings, numbers, ``True`` /
``true``, ``None`` / ``null``, lists, dicts): the block is parsed with ``ast``, never run, and anything else (a
positional argument, a variable, an expression) makes the block a parse error. Text outside the blocks is
content; a trailing block without its closing fence is parsed too.
"""

from __future__ import annotations

import ast
import re
from typing import Any, Optional

from training.openai_api.tool_parsers.base import ParsedCalls, ToolCall, ToolParser, short, split_blocks

FENCE_OPEN, FENCE_CLOSE = "```tool_code", "```"
_BLOCK_RE = re.compile(r"```tool_code[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


def literal(node: ast.AST) -> Any:
    """The value of a literal expression node; raises ValueError naming anything that is not one."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        return {literal(k): literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError(f"argument value {ast.unparse(node)!r} is not a literal")


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise ValueError(f"{ast.unparse(node)!r} is not a function name")


def _calls_of(node: ast.AST) -> list[ast.Call]:
    """The call nodes one statement writes (a call, a list / tuple of calls, or ``print`` of those)."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print" and node.args:
        return [c for a in node.args for c in _calls_of(a)]
    if isinstance(node, ast.Call):
        return [node]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [c for e in node.elts for c in _calls_of(e)]
    raise ValueError(f"{ast.unparse(node)!r} is not a function call")


def _call(node: ast.Call, call_id: str) -> ToolCall:
    name = _dotted(node.func)
    if node.args:
        raise ValueError(f"{name}: positional arguments have no parameter names; write name=value")
    args = {}
    for kw in node.keywords:
        if kw.arg is None:
            raise ValueError(f"{name}: '**' arguments are not literals")
        args[kw.arg] = literal(kw.value)
    return ToolCall(id=call_id, name=name, arguments=args)


class GemmaToolParser(ToolParser):
    """```` ```tool_code ```` blocks of Python-style calls (Gemma)."""

    name = "gemma"
    call_open = (FENCE_OPEN,)
    call_close = FENCE_CLOSE
    opens_at_start = ("[",)
    example = '```tool_code\n<tool>(name="value", count=1)\n```'
    template_markers = (FENCE_OPEN,)

    def parse(
        self, text: str, id_prefix: str = "call_", *, first_index: int = 0, tools: Optional[list[dict]] = None
    ) -> ParsedCalls:
        bare = text.strip()
        if FENCE_OPEN not in text and bare.startswith("[") and bare.endswith("]"):
            listed = self._block(bare, ParsedCalls(), id_prefix, first_index)
            return listed if listed.calls and not listed.errors else ParsedCalls(content=bare)
        content, bodies = split_blocks(_BLOCK_RE, text)
        out = ParsedCalls(content=content)
        for body in bodies:
            self._block(body.strip(), out, id_prefix, first_index)
        return out

    def _block(self, body: str, out: ParsedCalls, id_prefix: str, first_index: int) -> ParsedCalls:
        """Adds the calls of one block of Python statements to ``out`` (or one error, naming what is wrong)."""
        try:
            statements = ast.parse(body, mode="exec").body
            nodes = [c for s in statements for c in _calls_of(s.value if isinstance(s, ast.Expr) else s)]
            if not nodes:
                raise ValueError("the block holds no call")
            index = first_index + len(out.calls) + len(out.errors)
            out.calls.extend([_call(n, self.call_id(id_prefix, index + i)) for i, n in enumerate(nodes)])
        except SyntaxError as e:
            out.errors.append(f"tool_code is not Python call syntax ({e.msg}): {short(body)}")
        except (ValueError, RecursionError) as e:
            out.errors.append(f"{e}: {short(body)}")
        return out
