"""The KL penalty in the reward instead of the loss (``LossConfig.kl_in_reward``).

With it on, the loss adds no KL term; before the PPO inner loop each trained token t of a sample gets

    a_t = A_t - beta * sum_{t' >= t, trained} k(l_old[t'] - l_ref[t'])

where ``A_t`` is the sample's advantage (a scalar repeated, or its per-token value), ``k`` the estimator of
``LossConfig.kl_estimator`` (k1 d, k2 d^2 / 2, k3 exp(-d) + d - 1; ``common.kl_to_reference``) and ``l_old`` the
trainer's logprobs before the step's first update. The sum is the penalty's return-to-go with gamma = 1: each token is
charged for the divergence it and the tokens after it add, as PPO-RLHF's per-token KL reward does, here added to the
group-relative advantage without renormalising it. Untrained tokens keep ``A_t``. The per-sample penalty
``beta * sum_t k_t`` is logged as ``train/kl_reward_penalty_mean``.
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

from training.utils.rl.losses.common import kl_to_reference


def kl_reward_advantages(
    advantages: Sequence[Union[float, list[float]]],
    old_logprobs: Sequence[Sequence[float]],
    ref_logprobs: Sequence[Sequence[float]],
    loss_masks: Sequence[Sequence[int]],
    beta: float,
    estimator: str,
) -> tuple[list[list[float]], list[float]]:
    """Per-token advantages with the KL penalty's return-to-go subtracted (module docstring), and each sample's
    penalty ``beta * sum_t k_t`` over its trained tokens. Computed in float64."""
    out, penalties = [], []
    for a, old, ref, mask in zip(advantages, old_logprobs, ref_logprobs, loss_masks):
        mask_T = torch.tensor(mask, dtype=torch.float64)
        k_T = (
            kl_to_reference(torch.tensor(old, dtype=torch.float64), torch.tensor(ref, dtype=torch.float64), estimator)
            * mask_T
        )
        to_go_T = k_T.flip(0).cumsum(0).flip(0)
        base_T = torch.tensor(a, dtype=torch.float64) if isinstance(a, list) else torch.full_like(mask_T, float(a))
        out.append((base_T - beta * to_go_T * mask_T).tolist())
        penalties.append(beta * float(k_T.sum()))
    return out, penalties
