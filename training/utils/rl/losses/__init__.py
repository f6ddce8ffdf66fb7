"""The policy losses: ``LossConfig`` (``config.py``), the registry (``registry.py``) and the entry point
the trainer calls (``compute.py``).

``compute_policy_loss(inputs, cfg, total_tokens, total_sequences)`` runs the loss named by
``cfg.policy_loss`` (or the user's callable) on one packed micro-batch and reduces it with
step-wide denominators. See ``README.md`` in this folder for the formulas.

The names of ``compute.py`` (and the loss modules, which need torch) are loaded on first use
(PEP 562 ``__getattr__``), so that ``LossConfig``, and with it every config class and
``python train.py --help``, imports without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import RegisteredLoss, loss_names

_FROM_COMPUTE = (
    "LOSSES",
    "LOSSES_USING_REFERENCE",
    "compute_policy_loss",
    "loss_aggregation",
    "needs_reference_logprobs",
    "registered_loss",
    "resolve_loss",
)
_FROM_COMMON = ("LossFn", "LossInputs", "LossOutput")


def __getattr__(name: str) -> Any:
    if name in _FROM_COMPUTE:  # LOSSES too: through compute.py, so that it is filled
        return getattr(importlib.import_module("training.utils.rl.losses.compute"), name)
    if name in _FROM_COMMON:
        return getattr(importlib.import_module("training.utils.rl.losses.common"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["LossConfig", "RegisteredLoss", "loss_names", *_FROM_COMPUTE, *_FROM_COMMON]
