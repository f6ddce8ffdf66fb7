"""A test instrument: embedded servers on the tiny model, one per distinct settings, shared across modules.

``EmbeddedServers`` is the session's pool behind the ``embedded_server`` fixture (tests/conftest.py); each
module asks through its own ``Owner``. Settings are keywords: ``DeployConfig`` fields and every
``EngineConfig`` field flat beside them (``api_key="k", max_batch_size=8``), plus ``model`` (another
folder than the tiny model), ``served_model_name`` and ``extra_args``. A server is either

- **shared** (the default): the pool's server for exactly these settings (model, served name, extra
  arguments, every config field), started on first use and handed to every later module that asks for the
  same. Only tests that leave the server as they found it may use one. Once no module holds it, it waits
  for the next module that asks; at most ``IDLE_SHARED`` wait, and beyond that the one asked for by the
  fewest modules so far stops (the oldest among equals: settings several modules asked for, as a folder's
  modules do, are the likeliest to be asked for again); it starts again if asked for later. All stop when
  the session ends.
- **fresh** (``fresh=True``): a server of its own, for tests that change the server's state (a weight push,
  even one they undo; sleep; pause; a weight group; a kill; sessions or counters they check). It stops when
  its module ends, or earlier on leaving a ``with`` block.

The engine runs on the CPU in fp32 unless ``device`` / ``dtype`` say otherwise (what ``auto`` resolves to in
the CPU suite anyway). The pool names each server's log file itself, so a log path never makes two servers
differ; ``starts`` counts the servers it started.
"""

from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from training.deployment.backends.embedded import EmbeddedDeployment
from training.utils.config import DeployConfig, EngineConfig

DEPLOY_FIELDS = frozenset(f.name for f in dataclasses.fields(DeployConfig)) - {"engine_config", "log_file"}
ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig)) - {"model"}
CPU_ENGINE = {"device": "cpu", "dtype": "float32"}
"""The engine settings every server gets unless the caller names others."""
IDLE_SHARED = 4
"""Shared servers kept running while no module holds them (about 190 MB each)."""


def deploy_config(settings: dict[str, Any]) -> DeployConfig:
    """``DeployConfig`` fields and flat ``EngineConfig`` fields -> one ``DeployConfig``; an unknown name is a TypeError."""
    unknown = sorted(set(settings) - DEPLOY_FIELDS - ENGINE_FIELDS)
    if unknown:
        raise TypeError(f"embedded_server: {unknown} are neither DeployConfig nor EngineConfig settings")
    engine = {**CPU_ENGINE, **{k: v for k, v in settings.items() if k in ENGINE_FIELDS}}
    deploy = {k: v for k, v in settings.items() if k in DEPLOY_FIELDS}
    return DeployConfig(**deploy, engine_config=EngineConfig(**engine))


class EmbeddedServers:
    """The session's embedded servers: shared ones by settings, and every one started, to stop at the end."""

    def __init__(self, default_model: str, log_dir: Path):
        self.default_model = default_model
        self.log_dir = Path(log_dir)
        self.shared: dict[str, EmbeddedDeployment] = {}
        self.holders: dict[str, int] = {}
        """Per shared server: how many modules hold it now."""
        self.asked: dict[str, int] = {}
        """Per settings: how many times a module asked for them."""
        self.idle: list[str] = []
        """Shared servers no module holds, in the order they were let go."""
        self.started: list[EmbeddedDeployment] = []
        self.starts = 0
        """Servers started so far (a shared server handed out again is not a start)."""

    def _server(
        self,
        model: Optional[str] = None,
        served_model_name: Optional[str] = None,
        extra_args: Iterable[str] = (),
        **settings: Any,
    ) -> tuple[str, Callable[[], EmbeddedDeployment]]:
        """(the settings' key, a function that makes an unstarted server with them and its own log file)."""
        model = str(model or self.default_model)
        extra_args = list(extra_args)
        cfg = deploy_config(settings)
        key = json.dumps([model, served_model_name, extra_args, dataclasses.asdict(cfg)], default=str)

        def make() -> EmbeddedDeployment:
            log = self.log_dir / f"server-{len(self.started):02d}.log"
            dep = EmbeddedDeployment(
                model,
                dataclasses.replace(cfg, log_file=str(log)),
                served_model_name=served_model_name,
                extra_args=extra_args,
            )
            self.started.append(dep)
            return dep

        return key, make

    def key_of(self, **settings: Any) -> str:
        """What makes two servers the same: the model, served name, extra arguments and every config field."""
        return self._server(**settings)[0]

    def acquire(self, **settings: Any) -> EmbeddedDeployment:
        """The shared server for these settings, started if none runs; the caller holds it until ``release(key)``."""
        key, make = self._server(**settings)
        if key not in self.shared:
            self.shared[key] = make().start()
            self.starts += 1
        if key in self.idle:
            self.idle.remove(key)
        self.holders[key] = self.holders.get(key, 0) + 1
        self.asked[key] = self.asked.get(key, 0) + 1
        return self.shared[key]

    def release(self, key: str) -> None:
        """No longer held by one module: idle once nobody holds it; beyond ``IDLE_SHARED`` idle, the one asked for
        least (the oldest among equals) stops."""
        self.holders[key] -= 1
        if self.holders[key] == 0:
            self.idle.append(key)
        while len(self.idle) > IDLE_SHARED:
            least = min(self.idle, key=lambda k: (self.asked[k], self.idle.index(k)))
            self.idle.remove(least)
            self.shared.pop(least).stop()

    def fresh(self, *settings: dict[str, Any]) -> list[EmbeddedDeployment]:
        """New servers, one per settings dict, started at the same time (their start-ups overlap)."""
        deps = [self._server(**s)[1]() for s in settings]
        with ThreadPoolExecutor(len(deps)) as pool:
            list(pool.map(EmbeddedDeployment.start, deps))
        self.starts += len(deps)
        return deps

    def close(self) -> None:
        """Stop every server the pool started (each stop is idempotent)."""
        for dep in self.started:
            dep.stop()


class Owner:
    """One module's handle on the pool (what the ``embedded_server`` fixture gives): ``owner(**settings)``, and
    ``owner.together(settings, ...)`` for fresh servers started at once; ``close()`` at the module's end stops
    its fresh servers and lets go of the shared ones."""

    def __init__(self, pool: EmbeddedServers):
        self.pool = pool
        self.fresh: list[EmbeddedDeployment] = []
        self.held: set[str] = set()

    def __call__(self, *, fresh: bool = False, **settings: Any) -> EmbeddedDeployment:
        if fresh:
            return self.together(settings)[0]
        key = self.pool.key_of(**settings)
        if key in self.held:  # one hold per module
            return self.pool.shared[key]
        dep = self.pool.acquire(**settings)
        self.held.add(key)
        return dep

    def together(self, *settings: dict[str, Any]) -> list[EmbeddedDeployment]:
        """Fresh servers, one per settings dict, started at the same time."""
        deps = self.pool.fresh(*settings)
        self.fresh.extend(deps)
        return deps

    def close(self) -> None:
        for dep in self.fresh:
            dep.stop()
        for key in self.held:
            self.pool.release(key)
