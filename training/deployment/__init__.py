"""The inference deployment: an OpenAI-compatible server over the generation engine, its
client, its launcher and weight sync. See README.md in this folder.

Names are imported lazily so that ``from training.deployment import DeploymentSampler``
does not load torch or the engine.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "DeploymentSampler": "training.deployment.client",
    "Completion": "training.deployment.client",
    "DeploymentRequestError": "training.deployment.client",
    "build_deployment_sampler": "training.deployment.client",
    "DeploymentGroup": "training.deployment.group",
    "push_weights": "training.deployment.group",
    "make_deployment": "training.deployment.backends.registry",
    "make_sampler": "training.deployment.backends.registry",
    "ServerProcess": "training.deployment.backends.process",
    "DeploymentStartError": "training.deployment.backends.process",
    "EmbeddedDeployment": "training.deployment.backends.embedded",
    "WeightSyncError": "training.deployment.weights.files",
    "create_app": "training.deployment.server.app",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'training.deployment' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
