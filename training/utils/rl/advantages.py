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


def group_advantages(rewards_G: list[float], scale_by_std: bool = True,
                     targets: list[float] | None = None) -> list[float]:
    """Advantages of one prompt group's samples, in the order of ``rewards_G``.

    With ``targets`` (per-segment rewards of runs that credit each call separately), returns
    ``(target - mean_G R) / (std_G R + 1e-8)`` for each target instead, normalised by the
    statistics of the group's run rewards ``rewards_G``; a zero-variance group still gives 0.
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
    values = rewards_G if targets is None else targets
    if max(rewards_G) == min(rewards_G):
        return [0.0] * len(values)
    mean = math.fsum(rewards_G) / size
    std = math.sqrt(math.fsum((float(r) - mean) ** 2 for r in rewards_G) / (size - 1))
    scale = 1.0 / (std + STD_EPSILON) if scale_by_std else 1.0
    return [(float(v) - mean) * scale for v in values]
