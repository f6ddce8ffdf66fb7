"""cispo: clipped importance-sampling weight as a detached coefficient of the log-likelihood.

    r_t = exp(clamp(l_t - l_old_t, ±20))
    L_t = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) · l_t · A · w_t

Unlike PPO clipping, a clipped token still gets a gradient (through l_t); the clip only bounds
its weight. w_t is the TIS weight. No KL term.

Defaults: eps_low = 0.2, eps_high = 0.28.
Metrics: ``clip_fraction`` (tokens whose ratio lies outside [1 - eps_low, 1 + eps_high]),
``ratio_mean``, ``ratio_max``.
"""

from __future__ import annotations

from training.utils.rl.losses.common import LossInputs, LossOutput, clip_eps, policy_ratio, ratio_metrics, tis_weight
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss

DEFAULT_EPS_LOW = 0.2
DEFAULT_EPS_HIGH = 0.28


@register_loss("cispo")
def cispo_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token cispo loss (see the module docstring)."""
    eps_low, eps_high = clip_eps(cfg, DEFAULT_EPS_LOW, DEFAULT_EPS_HIGH)
    ratio_N = policy_ratio(inputs).detach()
    clipped_ratio_N = ratio_N.clamp(1.0 - eps_low, 1.0 + eps_high)
    clipped_N = clipped_ratio_N != ratio_N
    weight_N, _ = tis_weight(inputs, cfg)
    loss_N = -clipped_ratio_N * inputs.logprobs_N * inputs.advantages_N * weight_N
    return LossOutput(loss_N, ratio_metrics(ratio_N, clipped_N, inputs.loss_mask_N))
