"""What a ``unit`` test may not do (no model, no server), in its own process and in every Python it starts.

``REFUSALS`` names each thing once: the function that does it, and what a test requests instead (which
takes it out of ``unit``; tests/README.md). tests/conftest.py replaces these functions while a ``unit``
test runs: at once in the modules already imported, and through ``RefuseOnImport`` in those the test
imports later. ``sitecustomize.py`` beside this file does the same in the test's child processes, where a
refusal is also appended to the file ``$TRAINING_UNIT_GUARD_LOG``, so that the test fails even when the
child swallows the error. Standard library only: children import this first.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Callable

TINY = "the `tiny_model_path` fixture (or `tiny_llama_path`, `tiny_teacher_path`)"
REFUSALS = [
    ("training.models.build_tiny", "ensure_tiny_model", "asks for the tiny model", TINY),
    ("training.models.build_tiny", "build_tiny", "builds a tiny model", TINY),
    ("training.models.smollm2", "ensure_smollm2", "asks for SmolLM2", "the `smollm2_path` fixture"),
    ("transformers.modeling_utils", "PreTrainedModel.__init__", "builds a transformers model", TINY),
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase.from_pretrained", "loads a tokenizer", TINY),
    (
        "training.deployment.backends.embedded",
        "EmbeddedDeployment._command",
        "launches the embedded server",
        "the `embedded_server` fixture",
    ),
]
"""(module, attribute in it, what calling it does, what to request instead)."""

TEST_ENV = "TRAINING_UNIT_TEST"
"""Names the running ``unit`` test, in the environment its children inherit."""
LOG_ENV = "TRAINING_UNIT_GUARD_LOG"
"""A file the children append their refusals to; the test fails when it is not empty."""

Refuse = Callable[[object, str, str, str], None]
"""``refuse(module, attribute, what, request)``: replace ``module.attribute`` by a refusal."""


def message(nodeid: str, what: str, request: str) -> str:
    return f"{nodeid} runs as `unit` (no model, no server) but {what}: request {request}, which takes it out of `unit`"


def target(module, attribute: str) -> tuple[object, str]:
    """(the object holding the attribute, its last name): ``PreTrainedModel.__init__`` -> (PreTrainedModel, "__init__")."""
    *path, name = attribute.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


class RefuseOnImport(importlib.abc.MetaPathFinder):
    """A first entry of ``sys.meta_path``: once a module of ``REFUSALS`` has been executed, ``refuse`` its entries."""

    def __init__(self, refuse: Refuse):
        self.refuse = refuse

    def find_spec(self, name, path, target=None):
        if not any(module == name for module, *_ in REFUSALS):
            return None
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target) if finder is not self and hasattr(finder, "find_spec") else None
            if spec is not None:
                break
        else:
            return None
        if spec.loader is None:
            return spec
        execute, refuse = spec.loader.exec_module, self.refuse

        def exec_module(module):
            execute(module)
            for mod, attribute, what, request in REFUSALS:
                if mod == name:
                    refuse(module, attribute, what, request)

        spec.loader.exec_module = exec_module
        return spec


def install_in_child() -> None:
    """In a process started by a ``unit`` test: refuse ``REFUSALS`` from their modules' import on."""
    nodeid = os.environ.get(TEST_ENV)
    if not nodeid:
        return

    def refuse(module, attribute: str, what: str, request: str) -> None:
        text = message(nodeid, what + " (in a child process)", request)

        def refused(*args, **kwargs):
            log = os.environ.get(LOG_ENV)
            if log:
                with open(log, "a") as f:
                    f.write(text + "\n")
            raise SystemExit(text)

        owner, name = target(module, attribute)
        setattr(owner, name, refused)

    sys.meta_path.insert(0, RefuseOnImport(refuse))
