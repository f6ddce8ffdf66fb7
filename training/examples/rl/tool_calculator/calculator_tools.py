"""The example's tools: a safe ``calculator`` (``ast``, never ``eval``) and ``lookup_price`` (SQLite)."""

from __future__ import annotations

import ast
import operator
import sqlite3
import threading

from training.agents import Tool

PRICES = {"apple": 3, "banana": 2, "pencil": 2, "pen": 4, "notebook": 5, "book": 12, "bag": 20, "lamp": 15}
"""Item -> price in coins: the rows of the lookup table (data.jsonl answers are computed from it)."""

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 64
MAX_MAGNITUDE = 10**18


def evaluate(expression: str) -> int | float:
    """Value of an arithmetic expression over numbers with + - * / // % ** and parentheses.

    Raises ValueError for anything else (names, calls, attributes, huge powers or results).
    """
    if not isinstance(expression, str) or not expression.strip():
        raise ValueError("expression must be a non-empty string")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def walk(node: ast.AST) -> int | float:
        if isinstance(node, ast.Expression):
            return walk(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            value = _BINARY[type(node.op)](left, right)  # ZeroDivisionError is reported as a tool error
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            value = _UNARY[type(node.op)](walk(node.operand))
        else:
            raise ValueError(f"unsupported syntax: {type(node).__name__}")
        if isinstance(value, complex) or abs(value) > MAX_MAGNITUDE:
            raise ValueError("result out of range")
        return value

    value = walk(tree)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


class CalculatorTool(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression such as '17 + 25 * 3' (operators + - * / // % ** and parentheses)."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def apply(self, expression: str) -> str:
        return str(evaluate(expression))


class PriceLookupTool(Tool):
    """Prices from an in-memory SQLite table (one connection, guarded by a lock: tools run in threads)."""

    name = "lookup_price"
    description = "Price in coins of one item from the shop's table, e.g. 'pencil'."
    parameters = {"type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}

    def __init__(self, prices: dict[str, int] = PRICES):
        self._lock = threading.Lock()
        self._db = sqlite3.connect(":memory:", check_same_thread=False)
        self._db.execute("CREATE TABLE prices (item TEXT PRIMARY KEY, price INTEGER NOT NULL)")
        self._db.executemany("INSERT INTO prices VALUES (?, ?)", sorted(prices.items()))

    def apply(self, item: str) -> str:
        name = item.strip().lower()
        with self._lock:  # "pencils" finds "pencil"
            row = self._db.execute(
                "SELECT price FROM prices WHERE item IN (?, ?) ORDER BY length(item) DESC",
                (name, name[:-1] if name.endswith("s") else name),
            ).fetchone()
            known = [r[0] for r in self._db.execute("SELECT item FROM prices ORDER BY item")]
        if row is None:
            raise KeyError(f"no item named {item!r}; known items: {', '.join(known)}")
        return str(row[0])
