"""``python train.py key=value ...``: override fields of a config from the command line.

Dotted keys reach sub-configs (``trainer.learning_rate=3e-4``, ``loss.policy_loss=gspo``).
Each value is converted to the type the field is annotated with (``parse_value``): an ``int``
field refuses ``5.5``, a ``str`` field keeps ``2024`` as the string ``"2024"``, ``Optional``
fields take ``null``, lists and tuples take JSON (``'[0.9, 0.99]'``), booleans take
``true``/``false``. ``--help`` lists every field with the docstring written under it.
Overrides are applied with ``dataclasses.replace``, so each config validates itself again; a bad
value stops with one message that names the dotted key.

A config class may declare ``CLI_ALIASES = {"alias": "canonical.path"}`` (``Config`` does, for
the documented top-level ``learning_rate`` / ``policy_loss`` / ``kl_beta``): an override of the
alias sets the canonical field, so the two spellings are one setting.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import sys
import textwrap
import types
import typing
from typing import Any, Optional, TypeVar, Union

T = TypeVar("T")


class OverrideError(ValueError):
    """A ``key=value`` that cannot be applied; the message names the key."""


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
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(getattr(nxt, "value", None), ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def field_types(cls: type) -> dict[str, Any]:
    """Each field's annotation, resolved (``from __future__ import annotations`` leaves strings)."""
    return typing.get_type_hints(cls)


def help_text(cfg: Any, prefix: str = "") -> str:
    """One entry per field: ``dotted.name=current value`` and its docstring; aliases say what they set."""
    lines = []
    docs = field_docs(type(cfg))
    aliases = getattr(type(cfg), "CLI_ALIASES", {})
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in aliases:
            lines.append(
                f"  {prefix}{f.name}=...\n      the same setting as {prefix}{aliases[f.name]} (either spelling)"
            )
        elif dataclasses.is_dataclass(value):
            lines.append(help_text(value, prefix + f.name + "."))
        else:
            lines.append(f"  {prefix}{f.name}={value!r}\n      {docs.get(f.name, '')}")
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def parse_value(raw: str, annotation: Any, name: str) -> Any:
    """``raw`` (a command-line string) as a value of ``annotation``; ``OverrideError`` naming ``name``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if type(None) in args and raw.strip().lower() in ("null", "none"):
            return None
        # try the structured options first, so base_url='["http://a", "http://b"]' becomes a list
        if len(options) == 1:
            return parse_value(raw, options[0], name)
        for option in sorted(options, key=lambda a: a is str):
            try:
                return parse_value(raw, option, name)
            except OverrideError:
                continue
        raise OverrideError(f"{name}: expected {' or '.join(_type_name(o) for o in options)}, got {raw!r}")
    if annotation is Any:
        return raw
    if annotation is bool:
        low = raw.strip().lower()
        if low in ("true", "1", "yes", "on"):
            return True
        if low in ("false", "0", "no", "off"):
            return False
        raise OverrideError(f"{name}: expected true or false, got {raw!r}")
    if annotation is int:
        try:
            return int(raw.strip())
        except ValueError:
            raise OverrideError(f"{name}: expected an integer, got {raw!r}") from None
    if annotation is float:
        try:
            return float(raw.strip())
        except ValueError:
            raise OverrideError(f"{name}: expected a number, got {raw!r}") from None
    if annotation is str:
        return raw
    if origin in (list, tuple, dict):
        try:
            data = json.loads(raw)
        except json.JSONDecodeError:
            raise OverrideError(f"{name}: expected JSON for a {_type_name(annotation)}, got {raw!r}") from None
        if origin is dict:
            if not isinstance(data, dict):
                raise OverrideError(f"{name}: expected a JSON object, got {raw!r}")
            key_t, value_t = args or (Any, Any)
            return {parse_value(str(k), key_t, name): _convert_json(v, value_t, name) for k, v in data.items()}
        if not isinstance(data, list):
            raise OverrideError(f"{name}: expected a JSON list, got {raw!r}")
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(data) != len(args):
                raise OverrideError(f"{name}: expected {len(args)} values, got {len(data)}")
            return tuple(_convert_json(v, t, name) for v, t in zip(data, args))
        item_t = args[0] if args else Any
        items = [_convert_json(v, item_t, name) for v in data]
        return tuple(items) if origin is tuple else items
    raise OverrideError(f"{name}: a {_type_name(annotation)} cannot be set from the command line")


def _convert_json(value: Any, annotation: Any, name: str) -> Any:
    """A JSON element converted like ``parse_value`` (numbers stay numbers, strings stay strings)."""
    if annotation is Any:
        return value
    if isinstance(value, str):
        return parse_value(value, annotation, name)
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if annotation is bool and isinstance(value, bool):
        return value
    return parse_value(json.dumps(value), annotation, name)


def _set(cfg: Any, path: list[str], raw: str, prefix: str = "") -> Any:
    cls = type(cfg)
    aliases = getattr(cls, "CLI_ALIASES", {})
    if path[0] in aliases:  # the documented spelling of a nested field: set that field
        path = aliases[path[0]].split(".") + path[1:]
    names = [f.name for f in dataclasses.fields(cfg)]
    key = prefix + path[0]
    if path[0] not in names:
        raise OverrideError(f"unknown config field {key!r}; {cls.__name__} has {sorted(names)} (see --help)")
    current = getattr(cfg, path[0])
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise OverrideError(f"{key}: is not a sub-config, so {key}.{path[1]} does not exist")
        value = _set(current, path[1:], raw, key + ".")
    elif dataclasses.is_dataclass(current):
        raise OverrideError(f"{key}: is a sub-config; set its fields, e.g. {key}.<field>=...")
    else:
        value = parse_value(raw, field_types(cls)[path[0]], key)
    changes = {path[0]: value}
    changes.update({alias: None for alias in aliases})  # aliases re-read the canonical fields
    try:
        return dataclasses.replace(cfg, **changes)
    except (ValueError, TypeError) as e:
        message = str(e)
        leaf = path[0] + ":"
        if prefix and message.startswith(leaf):  # name the field by its dotted key, once
            message = prefix + message
        raise OverrideError(message) from None


def apply_overrides(cfg: T, argv: Optional[list[str]] = None) -> T:
    """Return ``cfg`` with every ``key=value`` of ``argv`` (default ``sys.argv[1:]``) applied.

    ``--help`` prints the fields and exits; a bad override exits with one line naming the key.
    """
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: python {sys.argv[0]} [key=value ...]\n\nfields (current value, help):\n{help_text(cfg)}")
        raise SystemExit(0)
    for arg in argv:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {arg!r} (see --help)")
        try:
            cfg = _set(cfg, key.split("."), raw)
        except OverrideError as e:
            raise SystemExit(f"bad override {arg!r}: {e}") from None
    return cfg
