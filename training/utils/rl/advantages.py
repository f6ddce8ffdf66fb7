"""Group-relative advantages: each sample's reward compared with its prompt group's.

    A_i = (R_i - mean_G R) / (std_G R + 1e-8)      std unbiased (divides by G - 1)

A zero-variance group (all rewards equal) gets A = 0 for every member: it carries no learning
signal (a dynamic filter may drop it). With ``scale_by_std=False`` the advantage is mean-centred
only, A_i = R_i - mean_G R (Dr. GRPO), which does not up-weight groups whose rewards barely differ.
A group needs at least two samples: set ``completions_per_prompt >= 2``.
"""

from __future__ import annotations

import math

STD_EPSILON = 1e-8
"""Added to the group std before dividing."""


def group_advantages(rewards_G: list[float], scale_by_std: bool = True) -> list[float]:
    """Advantages of one prompt group's samples, in the order of ``rewards_G``.

    Raises ``ValueError`` for a group of fewer than two samples or a non-finite reward.
    """
    size = len(rewards_G)
    if size < 2:
        raise ValueError(
            f"rewards_G: a group of {size} sample(s) cannot be normalised; "
            "completions_per_prompt must be >= 2 (and at least two samples of a group must survive)"
        )
    for i, reward in enumerate(rewards_G):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"rewards_G: rewards_G[{i}]={reward!r} is not a finite number")
    if max(rewards_G) == min(rewards_G):
        return [0.0] * size
    mean = math.fsum(rewards_G) / size
    centred_G = [float(r) - mean for r in rewards_G]
    if not scale_by_std:
        return centred_G
    std = math.sqrt(math.fsum(c * c for c in centred_G) / (size - 1))
    return [c / (std + STD_EPSILON) for c in centred_G]
