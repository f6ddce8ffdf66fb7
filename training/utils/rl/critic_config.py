"""``CriticConfig``: the settings of PPO's critic (``Config.critic``, ``advantage="gae"``), apart from the GAE
arithmetic in ``gae.py`` so that reading a config (``train.py --help``, ``python -m training.memory_plan``) imports
no torch."""

from __future__ import annotations

from dataclasses import dataclass

from training.utils.config import ConfigError


@dataclass
class CriticConfig:
    """The critic of ``advantage="gae"`` (``Config.critic``); unused by every other estimator."""

    gamma: float = 1.0
    """Discount per completion token, in [0, 1]."""
    lam: float = 1.0
    """GAE's lambda, in [0, 1]: 1 = Monte-Carlo return minus V, 0 = one-step TD error."""
    value_loss_coef: float = 0.5
    """Weight of the value loss added to the policy loss (it reaches only the value head's parameters)."""
    value_clip: float = 0.2
    """eps of the clipped value loss: V may move at most this far from V_old before the clipped term takes over
    (0 = no clipping)."""
    learning_rate: float = 1e-3
    """The value head's own AdamW learning rate (constant; its optimizer is separate from the policy's)."""
    whiten: bool = True
    """Normalise the step's GAE advantages to mean 0, std 1 over its trainable tokens."""

    def __post_init__(self):
        for name in ("gamma", "lam"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ConfigError(f"critic.{name}: must be a number in [0, 1], got {value!r}")
        for name in ("value_loss_coef", "value_clip"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0.0:
                raise ConfigError(f"critic.{name}: must be a number >= 0, got {value!r}")
        if isinstance(self.learning_rate, bool) or not (
            isinstance(self.learning_rate, (int, float)) and self.learning_rate > 0
        ):
            raise ConfigError(f"critic.learning_rate: must be a number > 0, got {self.learning_rate!r}")
