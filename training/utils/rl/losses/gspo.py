"""gspo: group sequence policy optimisation, token form, aggregated per sequence.

    s      = mean over the sequence's tokens with m = 1 of (l_t - l_old_t)   (masked tokens excluded)
    log rho_t = min(l_t - sg(l_t) + sg(s), gspo_log_ratio_cap)     (also clamped below at -20)
    L_t    = max(-rho_t·A, -clip(rho_t, 1 - eps_low, 1 + eps_high)·A) · w_t

The value of rho_t is the sequence ratio exp(s) on every token of the sequence; its gradient
w.r.t. l_t is rho_t, so the per-sequence mean (1/|y|) of the token losses has the GSPO gradient
exp(s)·(1/|y|)·sum_t grad l_t. Registered with aggregation ``"sequence_mean"`` (used unless
``cfg.aggregation`` is given): each sequence is averaged over its |y| trainable tokens, as the GSPO paper defines it. w_t is the TIS weight.

Defaults: eps_low = eps_high = 0.2, gspo_log_ratio_cap = 10. No KL term.
Metrics: ``clip_fraction``, ``ratio_mean``, ``ratio_max`` (of rho, i.e. the sequence ratios).
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.common import (
    LOG_RATIO_CLAMP,
    LossInputs,
    LossOutput,
    clip_eps,
    clipped_surrogate,
    masked_sequence_means,
    ratio_metrics,
    tis_weight,
)
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import register_loss

DEFAULT_EPS_LOW = 0.2
DEFAULT_EPS_HIGH = 0.2


@register_loss("gspo", aggregation="sequence_mean")
def gspo_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """Per-token gspo loss with sequence-mean aggregation (see the module docstring)."""
    eps_low, eps_high = clip_eps(cfg, DEFAULT_EPS_LOW, DEFAULT_EPS_HIGH)
    logprobs_N = inputs.logprobs_N
    with torch.no_grad():
        token_log_ratio_N = logprobs_N.detach() - inputs.old_logprobs_N.detach()
        seq_log_ratio_S = masked_sequence_means(
            token_log_ratio_N, inputs.loss_mask_N, inputs.sequence_index_N, inputs.num_sequences
        )
    log_ratio_N = logprobs_N - logprobs_N.detach() + seq_log_ratio_S[inputs.sequence_index_N]
    log_ratio_N = log_ratio_N.clamp(-LOG_RATIO_CLAMP, cfg.gspo_log_ratio_cap)
    ratio_N = torch.exp(log_ratio_N)
    surrogate_N, clipped_N = clipped_surrogate(ratio_N, inputs.advantages_N, eps_low, eps_high)
    weight_N, _ = tis_weight(inputs, cfg)
    metrics = ratio_metrics(ratio_N, clipped_N, inputs.loss_mask_N)
    return LossOutput(surrogate_N * weight_N, metrics)
