"""reinforce: the policy gradient with the ratio taken to the sampler directly.

    rho_t = exp(clamp(l_t - l_s_t, ±20))
    L_t   = -rho_t · A

No TIS weight (the ratio to the sampler already corrects for train/inference mismatch), no
clipping, no KL term; l_old is not used. At l = l_s the gradient is -A·dl, plain REINFORCE.
Metrics: ``ratio_mean`` and ``ratio_max`` of rho (the ratio to the sampler), ``clip_fraction`` = 0.
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.common import LossInputs, LossOutput, exp_clamped, ratio_metrics
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss


@register_loss("reinforce")
def reinforce_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token reinforce loss (see the module docstring)."""
    ratio_N = exp_clamped(inputs.logprobs_N - inputs.sampler_logprobs_N.detach())
    loss_N = -ratio_N * inputs.advantages_N
    not_clipped_N = torch.zeros_like(ratio_N, dtype=torch.bool)
    return LossOutput(loss_N, ratio_metrics(ratio_N, not_clipped_N, inputs.loss_mask_N))
