"""A second import path of the HTTP client, for code that imports ``training.deployment.sampler``.

``DeploymentSampler``, ``Completion``, ``DeploymentRequestError`` and ``build_deployment_sampler``
live in ``training/deployment/client.py``, named so that the HTTP client cannot be confused with the
engine's token sampler (``engine/token_sampler.py``); this module re-exports them, and new code
imports ``training.deployment.client`` (or ``training.deployment``).
"""

from training.deployment.client import (  # noqa: F401 - re-exported under this path
    Completion,
    DeploymentRequestError,
    DeploymentSampler,
    build_deployment_sampler,
)
