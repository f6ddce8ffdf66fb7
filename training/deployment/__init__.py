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
    "make_deployment": "training.deployment.factory",
    "make_sampler": "training.deployment.factory",
    "ServerProcess": "training.deployment.server_process",
    "DeploymentStartError": "training.deployment.server_process",
    "EmbeddedDeployment": "training.deployment.embedded",
    "WeightSyncError": "training.deployment.weight_sync",
    "create_app": "training.deployment.server",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'training.deployment' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
