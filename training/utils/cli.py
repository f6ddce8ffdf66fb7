"""``python train.py key=value ...``: override fields of a config from the command line.

Dotted keys reach sub-configs (``trainer.learning_rate=3e-4``, ``loss.policy_loss=gspo``);
values are parsed as JSON when they parse (numbers, true/false, null, lists) and kept as
strings otherwise. ``--help`` lists every field with the docstring written under it.
Overrides are applied with ``dataclasses.replace``, so each config validates itself again.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
from typing import Any, Optional, TypeVar

T = TypeVar("T")


def field_docs(cls: type) -> dict[str, str]:
    """The string literal written under each field of a dataclass (its help text)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and \
                    isinstance(nxt, ast.Expr) and isinstance(getattr(nxt, "value", None), ast.Constant) and \
                    isinstance(nxt.value.value, str):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def help_text(cfg: Any, prefix: str = "") -> str:
    lines = []
    docs = field_docs(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            lines.append(help_text(value, prefix + f.name + "."))
        else:
            lines.append(f"  {prefix}{f.name}={value!r}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


def _parse(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _set(cfg: Any, path: list[str], value: Any) -> Any:
    names = {f.name for f in dataclasses.fields(cfg)}
    if path[0] not in names:
        raise SystemExit(f"unknown config field {path[0]!r} in {type(cfg).__name__}; "
                         f"choose one of {sorted(names)} (or --help)")
    if len(path) > 1:
        value = _set(getattr(cfg, path[0]), path[1:], value)
    elif isinstance(getattr(cfg, path[0]), tuple) and isinstance(value, list):
        value = tuple(value)
    return dataclasses.replace(cfg, **{path[0]: value})


def apply_overrides(cfg: T, argv: Optional[list[str]] = None) -> T:
    """Return ``cfg`` with every ``key=value`` of ``argv`` (default ``sys.argv[1:]``) applied."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python {sys.argv[0]} [key=value ...]\n\nfields (current value, help):\n{help_text(cfg)}")
        raise SystemExit(0)
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {arg!r} (see --help)")
        try:
            cfg = _set(cfg, key.split("."), _parse(raw))
        except ValueError as e:
            raise SystemExit(f"{key}: {e}") from None
    return cfg
