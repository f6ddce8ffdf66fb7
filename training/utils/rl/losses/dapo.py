"""dapo: grpo's clipped surrogate with asymmetric clips ("clip-higher") and an optional dual clip.

    r_t   = exp(clamp(l_t - l_old_t, ±20))
    S_t   = max(-r_t·A, -clip(r_t, 1 - eps_low, 1 + eps_high)·A)
    L_t   = S_t · w_t                      where A >= 0 or dual clip is off
    L_t   = min(-c·A, S_t) · w_t           where A < 0 and cfg.dual_clip = c > 1

The dual clip bounds the loss of a negative-advantage token whose ratio has grown past c (its
gradient is then zero). w_t is the TIS weight. No KL term (``cfg.kl_beta`` is not used).

Defaults: eps_low = 0.2, eps_high = 0.28, dual clip off.
Metrics: ``clip_fraction``, ``dual_clip_fraction``, ``ratio_mean``, ``ratio_max``.
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.common import (
    LossInputs,
    LossOutput,
    clip_eps,
    clipped_surrogate,
    masked_mean,
    policy_ratio,
    ratio_metrics,
    tis_weight,
)
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss

DEFAULT_EPS_LOW = 0.2
DEFAULT_EPS_HIGH = 0.28


@register_loss("dapo")
def dapo_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token dapo loss (see the module docstring)."""
    eps_low, eps_high = clip_eps(cfg, DEFAULT_EPS_LOW, DEFAULT_EPS_HIGH)
    ratio_N = policy_ratio(inputs)
    advantages_N = inputs.advantages_N
    surrogate_N, clipped_N = clipped_surrogate(ratio_N, advantages_N, eps_low, eps_high)
    dual_clipped_N = torch.zeros_like(clipped_N)
    if cfg.dual_clip is not None:
        bound_N = -cfg.dual_clip * advantages_N
        dual_clipped_N = ((advantages_N < 0) & (bound_N < surrogate_N)).detach()
        surrogate_N = torch.where(dual_clipped_N, bound_N, surrogate_N)
    weight_N, _ = tis_weight(inputs, cfg)
    metrics = ratio_metrics(ratio_N, clipped_N, inputs.loss_mask_N)
    metrics["dual_clip_fraction"] = masked_mean(dual_clipped_N.to(ratio_N.dtype), inputs.loss_mask_N)
    return LossOutput(surrogate_N * weight_N, metrics)
