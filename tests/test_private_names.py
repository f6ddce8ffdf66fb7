"""No module of ``training/`` uses a private name (``_name``) that another module of ``training/`` defines.

A private name is a module's own business: when another module needs it, the owner gives it a public
operation with a contract (a docstring), or the code moves to the module that owns the data. The check reads
the source with ``ast`` (nothing is imported) and refuses, in a module M:

- ``obj._name`` (also ``getattr(obj, "_name")`` and its kin) where ``obj`` is not ``self`` / ``cls``, ``_name``
  is defined by another module of ``training/`` and M does not define ``_name`` itself (a module may use its
  own private names on any object: ``other._x`` on another instance of its own class);
- ``from training.x import _name`` (and a relative import of a private name).

"Defined" means a function, method or class, a module global, a class attribute, or an instance attribute
assigned through ``self`` / ``cls``. Third-party privates (``torch._C``, ``sys._getframe``, peft internals) are not
this rule's business: a name no module of ``training/`` defines is never flagged. ``ALLOWED`` holds the
third-party privates whose name happens to collide with one defined in ``training/``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Mapping

import pytest

pytestmark = pytest.mark.unit  # no model, no server: part of the sub-minute loop

ROOT = Path(__file__).resolve().parents[1]
ATTRIBUTE_FUNCTIONS = ("getattr", "setattr", "hasattr", "delattr")

ALLOWED = {
    # aiohttp's TCPConnector._close: the one synchronous way to drop a connector whose event loop is closed
    # (its public close() must be awaited on that loop); it collides with ``_close`` methods defined here.
    ("training/deployment/client.py", "_close"),
}
"""(module path, name): a third-party private name the scan cannot tell apart from one of ``training/``."""


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_self(node: ast.AST) -> bool:
    return isinstance(node, ast.Name) and node.id in ("self", "cls")


def defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, methods, classes, globals, class and instance attributes."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                for t in ast.walk(target):
                    if isinstance(t, ast.Name):
                        names.add(t.id)
                    elif isinstance(t, ast.Attribute) and _is_self(t.value):
                        names.add(t.attr)
    return {n for n in names if is_private(n)}


def private_uses(tree: ast.AST) -> Iterator[tuple[int, str, str]]:
    """(line, private name, source text) of every private attribute use on another object and private import."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and is_private(node.attr) and not _is_self(node.value):
            yield node.lineno, node.attr, ast.unparse(node)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ATTRIBUTE_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and is_private(node.args[1].value)
            and not _is_self(node.args[0])
        ):
            yield node.lineno, node.args[1].value, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] == "training"):
            for alias in node.names:
                if is_private(alias.name):
                    yield node.lineno, alias.name, f"from {'.' * node.level}{node.module or ''} import {alias.name}"


def violations(sources: Mapping[str, str], allowed=frozenset()) -> list[str]:
    """``path:line: text`` for each use of another module's private name among ``sources`` (path -> source)."""
    trees = {path: ast.parse(src) for path, src in sources.items()}
    defined = {path: defined_privates(tree) for path, tree in trees.items()}
    found = []
    for path, tree in trees.items():
        elsewhere = set().union(*(names for other, names in defined.items() if other != path))
        for line, name, text in private_uses(tree):
            imported = text.startswith("from ")
            if (imported or (name in elsewhere and name not in defined[path])) and (path, name) not in allowed:
                found.append((path, line, text))
    return [f"{path}:{line}: {text}" for path, line, text in sorted(set(found))]


def training_sources() -> dict[str, str]:
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted((ROOT / "training").rglob("*.py"))}


def test_no_module_of_training_uses_another_modules_private_name():
    found = violations(training_sources(), ALLOWED)
    assert not found, (
        "another module's private name used (give its owner a public operation with a docstring, or move the "
        "code to the module that owns the data):\n" + "\n".join(found)
    )


def test_every_allowed_name_is_still_used():
    """An entry of ``ALLOWED`` whose use is gone is dropped, so the list stays as short as the code needs."""
    sources = training_sources()
    stale = [
        (path, name)
        for path, name in sorted(ALLOWED)
        if path not in sources or not any(used == name for _, used, _ in private_uses(ast.parse(sources[path])))
    ]
    assert not stale, f"ALLOWED entries with no use left: {stale}"


def test_the_scan_flags_a_private_use_across_modules_and_nothing_else():
    owner = (
        "import sys\n"
        "_TABLE = {}\n"
        "class Server:\n"
        "    _limit = 3\n"
        "    def __init__(self):\n"
        "        self._refused = set()\n"
        "    def _exchange(self):\n"
        "        return sys._getframe()\n"  # third party: never flagged
        "    def merge(self, other):\n"
        "        return other._refused | self._refused\n"  # its own name on another instance: fine
    )
    caller = (
        "import torch\n"
        "from training.proxy.server import _TABLE\n"
        "from training.proxy import server\n"
        "def serve(proxy):\n"
        "    proxy._exchange()\n"
        "    torch._C._get_tracing_state()\n"  # third party
        "    getattr(proxy, '_refused', None)\n"
        "    return server._limit, proxy.__class__\n"
    )
    found = violations({"training/proxy/server.py": owner, "training/proxy/responses.py": caller})
    assert found == [
        "training/proxy/responses.py:2: from training.proxy.server import _TABLE",
        "training/proxy/responses.py:5: proxy._exchange",
        "training/proxy/responses.py:7: getattr(proxy, '_refused', None)",
        "training/proxy/responses.py:8: server._limit",
    ]
    assert violations({"training/a.py": caller}, {("training/a.py", "_TABLE")}) == []  # allowed, and nothing defined
