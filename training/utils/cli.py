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
alias sets the canonical field, so the two spellings are one setting, and giving both spellings
different values on one command line is an error naming both.

An unknown key stops with one line naming it and the closest known keys (``difflib``), nested
keys included (``trainer.learnig_rate`` → ``trainer.learning_rate``).

``--config FILE`` (JSON, or YAML when PyYAML is installed) applies a file of nested settings
first, then the ``key=value`` arguments on top. A run's own ``<log_path>/config.json`` is such a
file: a callable setting is recorded by name, and a name equal to the callable the script already
set is accepted as is (any other name cannot be turned back into a function and is refused).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import os
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar, Union

from training.utils.user_errors import install_excepthook

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
    if annotation in (list, tuple, dict):  # bare ``list``: JSON of any items
        origin = annotation
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


class UnknownKeyError(OverrideError):
    """A key that names no field; ``apply_overrides`` adds the closest known keys to the message."""

    def __init__(self, key: str):
        super().__init__(f"unknown config field {key!r}")
        self.key = key


Converter = Callable[[Any, str, Any], Any]
"""``(annotation, dotted key, current value) -> value``: turns one override's raw value into a field's value."""


def _set(cfg: Any, path: list[str], convert: Converter, prefix: str = "") -> Any:
    cls = type(cfg)
    aliases = getattr(cls, "CLI_ALIASES", {})
    if path[0] in aliases:  # the documented spelling of a nested field: set that field
        path = aliases[path[0]].split(".") + path[1:]
    names = [f.name for f in dataclasses.fields(cfg)]
    key = prefix + path[0]
    if path[0] not in names:
        raise UnknownKeyError(prefix + ".".join(path))
    current = getattr(cfg, path[0])
    if len(path) > 1:
        if not dataclasses.is_dataclass(current):
            raise OverrideError(f"{key}: is not a sub-config, so {key}.{path[1]} does not exist")
        value = _set(current, path[1:], convert, key + ".")
    elif dataclasses.is_dataclass(current):
        raise OverrideError(f"{key}: is a sub-config; set its fields, e.g. {key}.<field>=...")
    else:
        value = convert(field_types(cls)[path[0]], key, current)
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


def all_keys(cfg: Any, prefix: str = "") -> list[str]:
    """Every dotted key ``cfg`` accepts, aliases included."""
    keys = [prefix + alias for alias in getattr(type(cfg), "CLI_ALIASES", {})]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, prefix + f.name + ".")
        elif prefix + f.name not in keys:
            keys.append(prefix + f.name)
    return keys


def close_keys(cfg: Any, key: str, n: int = 3) -> list[str]:
    """The known keys closest to ``key``: fields of the same sub-config with a similar name, else fields
    anywhere whose own name is similar (``micro_batch_tokens`` → ``trainer.micro_batch_tokens``)."""
    parent, _, leaf = key.rpartition(".")
    keys = all_keys(cfg)
    siblings = {k.rpartition(".")[2]: k for k in keys if k.rpartition(".")[0] == parent}
    found = [siblings[m] for m in difflib.get_close_matches(leaf, list(siblings), n=n, cutoff=0.75)]
    if found:
        return found
    leaves = sorted({k.rpartition(".")[2] for k in keys})
    near = difflib.get_close_matches(leaf, leaves, n=n, cutoff=0.75)
    return [k for m in near for k in keys if k.rpartition(".")[2] == m][:n]


def canonical_key(cfg: Any, key: str) -> str:
    """``key`` with each alias replaced by the field it names (``learning_rate`` → ``trainer.learning_rate``)."""
    path, out = key.split("."), []
    while path:
        aliases = getattr(type(cfg), "CLI_ALIASES", {})
        if path[0] in aliases:
            path = aliases[path[0]].split(".") + path[1:]
        out.append(path.pop(0))
        cfg = getattr(cfg, out[-1], None)
    return ".".join(out)


def _from_text(raw: str) -> Converter:
    return lambda annotation, key, current: parse_value(raw, annotation, key)


def _from_file(value: Any) -> Converter:
    def convert(annotation: Any, key: str, current: Any) -> Any:
        if callable(current) and isinstance(value, str) and getattr(current, "__name__", None) == value:
            return current  # a run record names the callable the script already set: keep it
        return _convert_json(value, annotation, key)

    return convert


def _get(cfg: Any, dotted: str) -> Any:
    for name in dotted.split("."):
        cfg = getattr(cfg, name)
    return cfg


def _apply(cfg: T, items: list[tuple[str, str, Converter]], source: str) -> T:
    """Apply ``(key, shown, convert)`` items in order; stop with one message per bad item.

    Two spellings of one setting (an alias and its field) given different values are refused.
    """
    given: dict[str, tuple[str, Any]] = {}  # canonical key -> (spelling, value it set)
    for key, shown, convert in items:
        try:
            cfg = _set(cfg, key.split("."), convert)
        except UnknownKeyError as e:
            near = close_keys(cfg, e.key)
            hint = f"did you mean {' or '.join(near)}?" if near else "no field has a name like it"
            raise SystemExit(f"bad {source} {shown!r}: unknown config field {e.key!r}; {hint} (see --help)") from None
        except OverrideError as e:
            raise SystemExit(f"bad {source} {shown!r}: {e}") from None
        canonical = canonical_key(cfg, key)
        value = _get(cfg, canonical)
        if canonical in given and given[canonical][0] != key and given[canonical][1] != value:
            first, first_value = given[canonical]
            raise SystemExit(
                f"bad {source} {shown!r}: {first}={first_value!r} and {key}={value!r} are one setting; set one of them"
            )
        given[canonical] = (key, value)
    return cfg


def read_config_file(path: str | Path) -> dict:
    """A ``.json``, ``.yaml`` or ``.yml`` file's top-level mapping; ``SystemExit`` naming the file otherwise."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"--config {path}: no such file")
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError:
            raise SystemExit(f"--config {path}: reading YAML needs PyYAML (pip install pyyaml); or use JSON") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise SystemExit(f"--config {path}: not valid YAML: {e}") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--config {path}: not valid JSON: {e}") from None
    else:
        raise SystemExit(f"--config {path}: expected a .json, .yaml or .yml file")
    if not isinstance(data, dict):
        raise SystemExit(f"--config {path}: expected a mapping of settings at the top, got {type(data).__name__}")
    return data


def _file_items(cfg: Any, data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    """A nested mapping as ``(dotted key, value)`` pairs: a mapping under a sub-config's name is opened."""
    out = []
    for name, value in data.items():
        sub = getattr(cfg, str(name), None) if dataclasses.is_dataclass(cfg) else None
        if isinstance(value, dict) and dataclasses.is_dataclass(sub):
            out += _file_items(sub, value, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", value))
    return out


def apply_config_file(cfg: T, path: str | Path) -> T:
    """Return ``cfg`` with the settings of the file at ``path`` applied (see the module docstring)."""
    items = _file_items(cfg, read_config_file(path))
    return _apply(cfg, [(k, f"{k}: {v!r}", _from_file(v)) for k, v in items], f"setting in {path}")


def _split_argv(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """``--config FILE`` (or ``--config=FILE``) and the ``key=value`` arguments; ``--debug`` sets ``TRAINING_DEBUG=1``."""
    config, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--debug":  # a user error's traceback on the console (training/recipes/user_errors.py)
            os.environ["TRAINING_DEBUG"] = "1"
        elif arg == "--config" or arg.startswith("--config="):
            if config is not None:
                raise SystemExit("--config given twice; merge the files or use key=value for the rest")
            if arg == "--config":
                if i + 1 >= len(argv):
                    raise SystemExit("--config needs a file: --config run.yaml")
                config, i = argv[i + 1], i + 1
            else:
                config = arg.partition("=")[2]
        else:
            rest.append(arg)
        i += 1
    return config, rest


def apply_overrides(cfg: T, argv: Optional[list[str]] = None) -> T:
    """Return ``cfg`` with ``--config FILE`` and then every ``key=value`` of ``argv`` (default ``sys.argv[1:]``) applied.

    ``--help`` prints the fields and exits; a bad override exits with one line naming the key.
    """
    argv = sys.argv[1:] if argv is None else argv
    install_excepthook()  # a user error (a bad setting, a missing file) ends the run in one line
    if any(a in ("-h", "--help") for a in argv):
        print(
            f"usage: python {sys.argv[0]} [--config FILE.yaml|FILE.json] [--debug] [key=value ...]\n\n"
            f"fields (current value, help):\n{help_text(cfg)}"
        )
        raise SystemExit(0)
    config, args = _split_argv(argv)
    if config is not None:
        cfg = apply_config_file(cfg, config)
    items = []
    for arg in args:
        key, sep, raw = arg.partition("=")
        if not sep or not key:
            raise SystemExit(f"expected key=value, got {arg!r} (see --help)")
        items.append((key, arg, _from_text(raw)))
    return _apply(cfg, items, "override")
