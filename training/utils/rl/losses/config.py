"""``LossConfig``: which policy loss to train with and its parameters."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

from training.utils.rl.losses.registry import loss_names

AGGREGATIONS = ("token_mean", "sequence_mean", "sequence_mean_token_sum", "constant", "sum")
"""How per-token losses become the step loss (formulas: ``common.aggregate``, ``losses/README.md``)."""
SEQUENCE_AGGREGATIONS = ("sequence_mean", "sequence_mean_token_sum")
"""The aggregations in which every sequence counts once (the PPO step normalises sample weights per sequence)."""
TIS_LEVELS = ("token", "sequence", "off")
MIS_LEVELS = ("off", "token", "sequence", "geometric")
KL_ESTIMATORS = ("k1", "k2", "k3")
"""Per-token estimators of KL(pi || pi_ref) for the reference penalty (``common.kl_to_reference``)."""
"""Masked importance sampling (``common.mis_keep``): which ratio of exp(l_old - l_s) decides what is masked."""


class _Unset(str):
    """A default that was not given: equal to its string (``"grpo"`` for ``policy_loss``, ``"token_mean"`` for
    ``aggregation``) and serialised as it, but told from an explicit one (``LossConfig.policy_loss_given``,
    ``aggregation_given``). A dataclass default cannot otherwise tell the two apart; a distillation run picks its
    own loss only when none was given (``training/recipes/config.py``), a loss keeps its own aggregation."""

    __slots__ = ()


DEFAULT_POLICY_LOSS = _Unset("grpo")
"""The default of ``LossConfig.policy_loss``: ``"grpo"``, marked as not given."""
DEFAULT_AGGREGATION = _Unset("token_mean")
"""The default of ``LossConfig.aggregation``: ``"token_mean"``, marked as not given, so that a loss with an
aggregation of its own (gspo: ``sequence_mean``) keeps it unless one is given (``LossConfig.aggregation_given``)."""


@dataclass
class LossConfig:
    """The policy loss. ``policy_loss`` is a built-in loss name (a module of this folder, ``registry.loss_names()``) or a callable
    with the same signature as the built-in losses (see ``training.utils.rl.losses``)."""

    policy_loss: Union[str, Callable] = DEFAULT_POLICY_LOSS
    """A registered loss name (``grpo``, the default; every name with its formula in ``training/utils/rl/losses/README.md``) or a callable.
    Left unset it is ``DEFAULT_POLICY_LOSS`` (equal to ``"grpo"``; ``policy_loss_given`` is False)."""
    kl_beta: float = 0.001
    """Coefficient of the KL penalty to the reference model (grpo; 0 turns the reference off)."""
    kl_estimator: str = "k3"
    """The penalty's per-token estimate of KL(pi || pi_ref), with d = l - l_ref: ``k1`` d (unbiased, can be
    negative), ``k2`` d^2 / 2, ``k3`` exp(-d) + d - 1 (unbiased and >= 0; the default, as GRPO). All three are logged
    (``train/kl_ref_k1`` ...)."""
    kl_in_reward: bool = False
    """Charge the KL penalty in the advantages instead of the loss: each trained token's advantage loses ``kl_beta``
    times the estimator's sum over it and the tokens after it (``training/utils/rl/kl_reward.py``), and the loss adds
    no KL term. Needs ``kl_beta > 0``; any loss (the reference is loaded for it)."""
    reference_refresh_interval: int = 0
    """Every this many steps the reference model becomes a copy of the policy (after the step's update), so the KL
    penalty anchors to a recent policy instead of the start; 0 = never (the reference stays the start). The reference's
    weights are then checkpointed with the run. Needs ``kl_beta > 0``; not with LoRA (its reference is the base)."""
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
    aggregation: str = DEFAULT_AGGREGATION
    """How per-token losses become the step loss, for every loss: ``token_mean`` (sum over the step's trainable tokens /
    their count), ``sequence_mean`` (mean over sequences of each one's token mean), ``sequence_mean_token_sum`` (mean
    over sequences of each one's token sum), ``constant`` (token sum / (sequences · ``aggregation_constant``), Dr.
    GRPO's), ``sum``. Left unset, each loss's own (``token_mean``; gspo ``sequence_mean``)."""
    aggregation_constant: Optional[float] = None
    """The fixed per-sequence normaliser C of ``aggregation="constant"`` (Dr. GRPO uses the completion length limit,
    e.g. ``max_tokens``); required with it, unused otherwise."""
    mis_level: str = "off"
    """Masked importance sampling (rollout correction beyond TIS): tokens whose train/inference ratio
    rho = exp(l_old - l_s) lies outside [``mis_low``, ``mis_high``] are masked out of the loss. ``token`` judges each
    token's rho, ``sequence`` the sequence's product (exp of the sum over its trainable tokens), ``geometric`` its
    geometric mean (exp of the mean); ``off`` (the default) masks nothing."""
    mis_low: Optional[float] = None
    """Lower bound of the kept ratio; None = 1 / ``mis_high``."""
    mis_high: float = 2.0
    """Upper bound of the kept ratio (> 1)."""

    @property
    def policy_loss_given(self) -> bool:
        """False when ``policy_loss`` was left at its default (``DEFAULT_POLICY_LOSS``), True for any given value,
        ``"grpo"`` included."""
        return not isinstance(self.policy_loss, _Unset)

    @property
    def aggregation_given(self) -> bool:
        """False when ``aggregation`` was left at its default (``DEFAULT_AGGREGATION``): each loss then keeps its own."""
        return not isinstance(self.aggregation, _Unset)

    @property
    def mis_bounds(self) -> tuple[float, float]:
        """(low, high) of the kept train/inference ratio under ``mis_level`` (``mis_low`` None = 1 / ``mis_high``)."""
        return (1.0 / self.mis_high if self.mis_low is None else self.mis_low), self.mis_high

    def __post_init__(self):
        if isinstance(self.policy_loss, str) and self.policy_loss not in loss_names():
            raise ValueError(
                f"policy_loss: unknown loss {self.policy_loss!r}; choose one of {list(loss_names())} or pass a callable"
            )
        if not isinstance(self.policy_loss, str) and not callable(self.policy_loss):
            raise ValueError(f"policy_loss: must be a loss name or a callable, got {type(self.policy_loss).__name__}")
        if self.kl_beta < 0:
            raise ValueError(f"kl_beta: must be >= 0, got {self.kl_beta}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"kl_estimator: {self.kl_estimator!r} is not one of {KL_ESTIMATORS}")
        if not isinstance(self.reference_refresh_interval, int) or self.reference_refresh_interval < 0:
            raise ValueError(
                f"reference_refresh_interval: must be an int >= 0 (0 = never), got {self.reference_refresh_interval!r}"
            )
        if self.reference_refresh_interval and self.kl_beta <= 0:
            raise ValueError("reference_refresh_interval: needs kl_beta > 0 (without it no reference is loaded)")
        if self.kl_in_reward and self.kl_beta <= 0:
            raise ValueError("kl_in_reward: needs kl_beta > 0 (the penalty's coefficient), got kl_beta=0")
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
        if self.aggregation == "constant" and (self.aggregation_constant is None or not self.aggregation_constant > 0):
            raise ValueError(
                f"aggregation_constant: aggregation='constant' divides by it, so it must be > 0 (e.g. the run's "
                f"max_tokens), got {self.aggregation_constant!r}"
            )
        if self.aggregation_constant is not None and not self.aggregation_constant > 0:
            raise ValueError(f"aggregation_constant: must be > 0 (or None), got {self.aggregation_constant!r}")
        if self.mis_level not in MIS_LEVELS:
            raise ValueError(f"mis_level: {self.mis_level!r} is not one of {MIS_LEVELS}")
        if not self.mis_high > 1:
            raise ValueError(f"mis_high: must be > 1, got {self.mis_high}")
        if self.mis_low is not None and not 0 <= self.mis_low < 1:
            raise ValueError(f"mis_low: must be in [0, 1) (or None = 1 / mis_high), got {self.mis_low}")
        if self.dro_beta < 0:
            raise ValueError(f"dro_beta: must be >= 0, got {self.dro_beta}")
