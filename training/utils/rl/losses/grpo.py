"""grpo (the default): PPO's clipped surrogate, TIS-weighted, plus a KL penalty (k3 by default).

    r_t  = exp(clamp(l_t - l_old_t, ±20))
    L_t  = max(-r_t·A, -clip(r_t, 1 - eps_low, 1 + eps_high)·A) · w_t  +  kl_beta · k3_t
    k3_t = exp(l_ref_t - l_t) - (l_ref_t - l_t) - 1

``cfg.kl_estimator`` picks k1_t = l_t - l_ref_t or k2_t = (l_t - l_ref_t)^2 / 2 instead of k3_t.

w_t is the TIS weight (``common.tis_weight``). The KL term is added only when
``ref_logprobs_N`` is given and ``cfg.kl_beta > 0``; it is differentiable and not TIS-weighted.

Defaults: eps_low = eps_high = 0.2 (``cfg.eps_low`` / ``cfg.eps_high`` override), kl_beta = 0.001.
Metrics: ``clip_fraction`` (tokens where the clipped branch wins, so no gradient), ``ratio_mean``,
``ratio_max``.
"""

from __future__ import annotations

from training.utils.rl.losses.common import (
    LossInputs,
    LossOutput,
    clip_eps,
    clipped_surrogate,
    kl_to_reference,
    policy_ratio,
    ratio_metrics,
    tis_weight,
)
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss

DEFAULT_EPS_LOW = 0.2
DEFAULT_EPS_HIGH = 0.2


@register_loss("grpo", uses_reference=True)
def grpo_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token grpo loss (see the module docstring)."""
    eps_low, eps_high = clip_eps(cfg, DEFAULT_EPS_LOW, DEFAULT_EPS_HIGH)
    ratio_N = policy_ratio(inputs)
    surrogate_N, clipped_N = clipped_surrogate(ratio_N, inputs.advantages_N, eps_low, eps_high)
    weight_N, _ = tis_weight(inputs, cfg)
    loss_N = surrogate_N * weight_N
    if inputs.ref_logprobs_N is not None and cfg.kl_beta > 0:
        loss_N = loss_N + cfg.kl_beta * kl_to_reference(inputs.logprobs_N, inputs.ref_logprobs_N, cfg.kl_estimator)
    return LossOutput(loss_N, ratio_metrics(ratio_N, clipped_N, inputs.loss_mask_N))
