"""The registry of built-in policy losses: ``LOSSES`` maps each name to a ``RegisteredLoss``, the
facts the rest of the code reads about that loss (its function, its own aggregation, whether it uses
reference logprobs). Nothing outside this registry keeps a list of loss names or a rule about one.

A loss module registers its function with ``@register_loss(name, ...)``; ``compute.py`` imports every
loss module, so the registry is complete once ``compute.py`` (or a name the package loads from it) is
imported. ``loss_names()`` reads the names from the folder's file names without importing the loss
modules (which need torch), so ``LossConfig`` validates a name, and ``train.py --help`` runs, without
torch. This module imports nothing from the package (the loss modules import it), so no import cycle
forms.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class RegisteredLoss:
    """One built-in loss, as the registry knows it."""

    name: str
    """The ``LossConfig.policy_loss`` value that selects it; its module is ``<name>.py``, its function ``<name>_loss``."""
    fn: Callable[..., Any]
    """``common.LossFn``, ``(LossInputs, LossConfig) -> LossOutput``: the per-token loss (typed loosely: this
    module imports nothing from the package)."""
    aggregation: Optional[str] = None
    """The loss's own aggregation, used when ``LossConfig.aggregation`` is left unset (gspo: ``"sequence_mean"``,
    its definition); None = ``token_mean``. A given aggregation applies to every loss."""
    uses_reference: bool = False
    """Whether it adds a KL penalty to the reference model (grpo), so that ``kl_beta > 0`` loads one."""


LOSSES: dict[str, RegisteredLoss] = {}
"""Registered loss names → ``RegisteredLoss``, filled by ``@register_loss`` as the loss modules are imported."""


def register_loss(
    name: str, *, aggregation: Optional[str] = None, uses_reference: bool = False
) -> Callable[[Callable], Callable]:
    """Decorator for a built-in loss function: add it to ``LOSSES`` under ``name`` (once)."""

    def register(fn: Callable) -> Callable:
        if name in LOSSES:
            raise ValueError(
                f"policy loss {name!r} is registered twice ({LOSSES[name].fn.__module__}, {fn.__module__})"
            )
        LOSSES[name] = RegisteredLoss(name, fn, aggregation, uses_reference)
        return fn

    return register


NOT_LOSSES = frozenset({"__init__", "common", "compute", "config", "registry"})
"""The modules of this folder that are not losses; every other ``<name>.py`` is the loss ``<name>``."""


def loss_names() -> tuple[str, ...]:
    """The built-in loss names, read from this folder's file names (no loss module is imported)."""
    return tuple(sorted(p.stem for p in Path(__file__).parent.glob("*.py") if p.stem not in NOT_LOSSES))
