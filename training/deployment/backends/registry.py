"""Which classes serve ``DeployConfig.engine``: the server-process object and the sampler client.

    make_deployment("path/to/model", DeployConfig(engine="vllm"))   # not started yet
    make_sampler(["http://127.0.0.1:8000"], DeployConfig())

``DeploymentGroup`` (``group.py``) uses both to build a run's deployment; call them directly for one
server or one client.
"""

from __future__ import annotations

from typing import Any, Optional

from training.deployment.backends.process import ServerProcess
from training.utils.config import ENGINES, DeployConfig


def make_deployment(
    model: str, cfg: DeployConfig, *, log_file: Optional[str] = None, base_url: Optional[str] = None
) -> ServerProcess:
    """The server-process object for ``cfg.engine``, not started yet (use it as a context manager).

    ``embedded``: ``EmbeddedDeployment``; ``vllm``: ``VLLMDeployment``; ``sglang``: ``SGLangDeployment``.
    Each launches its server, or attaches to ``base_url`` (one URL) when given.
    """
    if cfg.engine == "embedded":
        from training.deployment.backends.embedded import EmbeddedDeployment

        return EmbeddedDeployment(model, cfg, log_file=log_file, base_url=base_url)
    if cfg.engine == "vllm":
        from training.deployment.backends.vllm import VLLMDeployment

        return VLLMDeployment(model, cfg, log_file=log_file, base_url=base_url)
    if cfg.engine == "sglang":
        from training.deployment.backends.sglang import SGLangDeployment

        return SGLangDeployment(model, cfg, log_file=log_file, base_url=base_url)
    raise ValueError(f"engine: {cfg.engine!r} is not one of {ENGINES}")


def make_sampler(base_urls: list[str], cfg: DeployConfig, tokenizer: Any = None) -> Any:
    """The ``DeploymentSampler`` for ``cfg.engine`` (SGLang's samples through its native /generate),
    with the retry and timeout settings of ``cfg``."""
    from training.deployment.client import DeploymentSampler

    kwargs = dict(
        api_key=cfg.api_key,
        timeout_s=cfg.request_timeout_s,
        max_retries=cfg.max_retries,
        backoff_s=cfg.retry_backoff_s,
        model=cfg.deployment_id,
    )
    if cfg.engine == "sglang":
        from training.deployment.backends.sglang import SGLangSampler

        return SGLangSampler(base_urls, tokenizer=tokenizer, **kwargs)
    return DeploymentSampler(base_urls, **kwargs)
