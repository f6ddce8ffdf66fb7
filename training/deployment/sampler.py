"""The old home of the HTTP client, kept so that code written against it still imports.

``DeploymentSampler``, ``Completion``, ``DeploymentRequestError`` and ``build_deployment_sampler``
now live in ``training/deployment/client.py`` (renamed so that the HTTP client cannot be confused
with the engine's token sampler, ``engine/token_sampler.py``). Earlier versions of the skills
(``skills/writing-a-rollout-function``) told users to import ``training.deployment.sampler``;
new code imports ``training.deployment.client`` (or ``training.deployment``).
"""

from training.deployment.client import (  # noqa: F401 - re-exported under the old path
    Completion,
    DeploymentRequestError,
    DeploymentSampler,
    build_deployment_sampler,
)
