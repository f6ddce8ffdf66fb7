"""importance_sampling: the unclipped importance-weighted policy gradient.

    r_t = exp(clamp(l_t - l_old_t, ±20))
    L_t = -r_t · A · w_t

w_t is the TIS weight (``common.tis_weight``). No clipping, no KL term.
Metrics: ``ratio_mean``, ``ratio_max``, ``clip_fraction`` (always 0: nothing is clipped).
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.common import LossInputs, LossOutput, policy_ratio, ratio_metrics, tis_weight
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss


@register_loss("importance_sampling")
def importance_sampling_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token importance_sampling loss (see the module docstring)."""
    ratio_N = policy_ratio(inputs)
    weight_N, _ = tis_weight(inputs, cfg)
    loss_N = -ratio_N * inputs.advantages_N * weight_N
    not_clipped_N = torch.zeros_like(ratio_N, dtype=torch.bool)
    return LossOutput(loss_N, ratio_metrics(ratio_N, not_clipped_N, inputs.loss_mask_N))
