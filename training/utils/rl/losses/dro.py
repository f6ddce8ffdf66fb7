"""dro: a direct policy-gradient term with a quadratic proximal penalty to the old policy.

    L_t = -( l_t · A · w_t  -  1/2 · dro_beta · (l_t - l_old_t)^2 )

w_t is the TIS weight; it multiplies the policy term only. Default dro_beta = 0.05.

Choice at A = 0: the quadratic term applies on every trainable token, including those of
sequences with zero advantage (the formula as written; the reference code switches it off where
A = 0 although its docstring says otherwise). It is a trust-region penalty that keeps the policy
near l_old whatever the advantage, so a zero-advantage token still pulls l back toward l_old.
No clipping, no KL term. Metrics: ``ratio_mean``, ``ratio_max`` of r = exp(l - l_old),
``clip_fraction`` = 0, ``dro_penalty`` (mean of 1/2·dro_beta·(l - l_old)^2).
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.common import LossInputs, LossOutput, masked_mean, policy_ratio, ratio_metrics, tis_weight
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss


@register_loss("dro")
def dro_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token dro loss (see the module docstring)."""
    weight_N, _ = tis_weight(inputs, cfg)
    penalty_N = 0.5 * cfg.dro_beta * (inputs.logprobs_N - inputs.old_logprobs_N.detach()) ** 2
    loss_N = -(inputs.logprobs_N * inputs.advantages_N * weight_N - penalty_N)
    ratio_N = policy_ratio(inputs).detach()
    metrics = ratio_metrics(ratio_N, torch.zeros_like(ratio_N, dtype=torch.bool), inputs.loss_mask_N)
    metrics["dro_penalty"] = masked_mean(penalty_N, inputs.loss_mask_N)
    return LossOutput(loss_N, metrics)
