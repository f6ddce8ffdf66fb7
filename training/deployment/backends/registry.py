"""Which classes serve ``DeployConfig.engine``: the server-process object and the sampler client.

    make_deployment("path/to/model", DeployConfig(engine="vllm"))   # not started yet
    make_sampler(["http://127.0.0.1:8000"], DeployConfig())

Both read the backend's entry of ``BACKENDS`` (training/utils/backends.py: the one table of what each backend
is and can do, on the ground floor so that ``DeployConfig`` checks it when it is built) and import the class it
names only when it is asked for, so importing this module loads no backend. ``DeploymentGroup`` (``group.py``)
uses both to build a run's deployment; call them directly for one server or one client.
"""

from __future__ import annotations

import importlib
from typing import Any, Optional

from training.deployment.backends.process import ServerProcess
from training.utils.backends import BACKENDS, Backend
from training.utils.config import DeployConfig, backend

__all__ = ["BACKENDS", "Backend", "backend", "load_class", "make_deployment", "make_sampler"]


def load_class(path: str) -> type:
    """The class a ``module:Class`` path of the table names (its module imported now)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def make_deployment(
    model: str, cfg: DeployConfig, *, log_file: Optional[str] = None, base_url: Optional[str] = None
) -> ServerProcess:
    """The server-process object of ``cfg.engine`` (``Backend.deployment``), not started yet (use it as a context
    manager). It launches its server, or attaches to ``base_url`` (one URL) when given."""
    cls = load_class(backend(cfg.engine).deployment)
    return cls(model, cfg, log_file=log_file, base_url=base_url)


def make_sampler(base_urls: list[str], cfg: DeployConfig, tokenizer: Any = None) -> Any:
    """The sampler client of ``cfg.engine`` (``Backend.sampler``: a ``DeploymentSampler``, SGLang's samples through
    its native /generate), with the retry and timeout settings of ``cfg``."""
    facts = backend(cfg.engine)
    kwargs = dict(
        api_key=cfg.api_key,
        timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        backoff_s=cfg.retry_backoff_s,
        model=cfg.deployment_id,
    )
    if facts.sampler_tokenizer:
        kwargs["tokenizer"] = tokenizer
    return load_class(facts.sampler)(base_urls, **kwargs)
