"""``LossConfig``: which policy loss to train with and its parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from training.utils.rl.losses.registry import loss_names

AGGREGATIONS = ("token_mean", "sequence_mean", "sum")
TIS_LEVELS = ("token", "sequence", "off")


class _UnsetLoss(str):
    """``policy_loss`` when none was given: equal to ``"grpo"`` and serialised as it, but a recipe can tell it from
    an explicit ``"grpo"`` (``LossConfig.policy_loss_given``). A dataclass default cannot otherwise tell the two
    apart; a distillation run picks its own loss only when none was given (``training/recipes/config.py``)."""

    __slots__ = ()


DEFAULT_POLICY_LOSS = _UnsetLoss("grpo")
"""The default of ``LossConfig.policy_loss``: ``"grpo"``, marked as not given."""


@dataclass
class LossConfig:
    """The policy loss. ``policy_loss`` is a built-in loss name (a module of this folder, ``registry.loss_names()``) or a callable
    with the same signature as the built-in losses (see ``training.utils.rl.losses``)."""

    policy_loss: Union[str, Callable] = DEFAULT_POLICY_LOSS
    """A registered loss name (``grpo``, the default; every name with its formula in ``training/utils/rl/losses/README.md``) or a callable.
    Left unset it is ``DEFAULT_POLICY_LOSS`` (equal to ``"grpo"``; ``policy_loss_given`` is False)."""
    kl_beta: float = 0.001
    """Coefficient of the k3 KL penalty to the reference model (grpo; 0 turns the reference off)."""
    eps_low: Optional[float] = None
    """Lower clip epsilon of the ratio; None = the loss's own default (0.2)."""
    eps_high: Optional[float] = None
    """Upper clip epsilon; None = the loss's own default (0.2; 0.28 for dapo and cispo)."""
    dual_clip: Optional[float] = None
    """dapo's dual clip c > 1 for negative advantages; None = off."""
    tis_cap: float = 5.0
    """Cap of the train/inference importance weight exp(l_old - l_sampler)."""
    tis_level: str = "token"
    """``token`` (per-token weight), ``sequence`` (geometric mean over the sequence) or ``off``."""
    dro_beta: float = 0.05
    """Weight of dro's quadratic penalty."""
    gspo_log_ratio_cap: float = 10.0
    """Upper cap of gspo's per-token log ratio."""
    aggregation: str = "token_mean"
    """How per-token losses become the step loss: ``token_mean`` over all trainable tokens of the step, ``sequence_mean``, or ``sum``."""

    @property
    def policy_loss_given(self) -> bool:
        """False when ``policy_loss`` was left at its default (``DEFAULT_POLICY_LOSS``), True for any given value,
        ``"grpo"`` included."""
        return not isinstance(self.policy_loss, _UnsetLoss)

    def __post_init__(self):
        if isinstance(self.policy_loss, str) and self.policy_loss not in loss_names():
            raise ValueError(
                f"policy_loss: unknown loss {self.policy_loss!r}; choose one of {list(loss_names())} or pass a callable"
            )
        if not isinstance(self.policy_loss, str) and not callable(self.policy_loss):
            raise ValueError(f"policy_loss: must be a loss name or a callable, got {type(self.policy_loss).__name__}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta: must be >= 0, got {self.kl_beta}")
        for name in ("eps_low", "eps_high"):
            v = getattr(self, name)
            if v is not None and not (0 <= v < 10):
                raise ValueError(f"{name}: must be in [0, 10), got {v}")
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ValueError(f"dual_clip: must be > 1 (or None), got {self.dual_clip}")
        if self.tis_cap <= 0:
            raise ValueError(f"tis_cap: must be > 0, got {self.tis_cap}")
        if self.tis_level not in TIS_LEVELS:
            raise ValueError(f"tis_level: {self.tis_level!r} is not one of {TIS_LEVELS}")
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation: {self.aggregation!r} is not one of {AGGREGATIONS}")
        if self.dro_beta < 0:
            raise ValueError(f"dro_beta: must be >= 0, got {self.dro_beta}")
