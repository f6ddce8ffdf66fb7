"""The advantages of one training step: the configured estimator on every group, then the batch normalisation.

``set_step_advantages(groups, estimator)`` is what the recipes call on a step's kept groups before the teacher
scores them (distillation reads the result as its task advantage) and before training. It sets each group's
``advantages`` with ``estimator`` (``PromptGroup.compute_advantages``: per-call credit and ``token_advantages``
included), and for a ``batch_normalised`` estimator (``reinforce_pp``) divides every scalar advantage of the step
by (their unbiased std over the step + 1e-4): ``advantages.batch_scale``. Per-token advantages a rollout gave
(``RolloutSample.token_advantages``) are the rollout's own and are neither counted nor rescaled. The formulas:
``advantages.py``.
"""

from __future__ import annotations

from training.utils.rl.advantages import batch_scale, estimator_of
from training.utils.rl.groups import PromptGroup


def set_step_advantages(groups: list[PromptGroup], estimator: str) -> None:
    """Set the advantages of ``groups`` (one step's batch) with ``estimator`` (see the module docstring)."""
    registered = estimator_of(estimator)
    for g in groups:
        g.compute_advantages(registered.name)  # the name passes through to credited_advantages
    if not registered.batch_normalised:
        return
    scale = batch_scale([a for g in groups for a in g.advantages if not isinstance(a, list)])
    for g in groups:
        g.advantages = [a if isinstance(a, list) else a * scale for a in g.advantages]
