"""Group-relative advantages: each sample's reward compared with its prompt group's.

    A_i = (R_i - mean_G R) / (std_G R + 1e-4)      std unbiased (divides by G - 1)

A zero-variance group (all rewards equal) gets A = 0 for every member: it carries no learning
signal (a dynamic filter may drop it). With ``scale_by_std=False`` the advantage is mean-centred
only, A_i = R_i - mean_G R (Dr. GRPO), which does not up-weight groups whose rewards barely differ.
A group needs at least two samples: set ``completions_per_prompt >= 2``.

Per-call credit (``credited_advantages``; a ``RolloutRun`` with ``segment_rewards``, e.g. the
transitions of ``training.agents`` and ``training.proxy``, ``credit.py``): sample s of completion c has its own reward r_s = g_s·R_c + i_s, where
R_c is the completion's return, g_s the share of it credited to this call (1, or gamma**(K-1-k)
for discounted credit: ``RolloutRun.return_weights``) and i_s = r_s - g_s·R_c its per-call
(intermediate) reward: tool-status penalties (AIR), rewards the agent posted. Then

    A_s = g_s · Â_c + (i_s - mean over the group's samples of i)
    Â_c = (R_c - mean_G R) / (std_G R + 1e-4)       (0 for a zero-variance group)

The return term is discounted together with its baseline (g_s·(R_c - mean R)), so a call of a
successful run never gets a negative return advantage for being early; the per-call term is
centred on the group's mean per-call reward and left in reward units, so it survives a group
whose returns are all equal (an all-failed group still learns which call broke). A sample
without per-call credit has g = 1 and i = 0, so it gets Â_c exactly.
"""

from __future__ import annotations

import math

STD_EPSILON = 1e-4
"""Added to the group std before dividing (TRL's value): large enough that a group whose rewards differ only by
float noise (a gap of 1e-7) gets advantages near 0 rather than ±1.25, small enough not to change a real spread
(a 0/1 group's std is ≥ 0.35: its advantages move by < 3e-4 relative)."""


def _check_group(rewards_G: list[float]) -> None:
    size = len(rewards_G)
    if size < 2:
        raise ValueError(
            f"rewards_G: a group of {size} sample(s) cannot be normalised; "
            "completions_per_prompt must be >= 2 (and at least two samples of a group must survive)"
        )
    for i, reward in enumerate(rewards_G):
        if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
            raise ValueError(f"rewards_G: rewards_G[{i}]={reward!r} is not a finite number")


def group_advantages(
    rewards_G: list[float], scale_by_std: bool = True, targets: list[float] | None = None
) -> list[float]:
    """Advantages of one prompt group's samples, in the order of ``rewards_G``.

    With ``targets``, returns ``(target - mean_G R) / (std_G R + 1e-4)`` for each target instead,
    normalised by the statistics of ``rewards_G``; a zero-variance group still gives 0.
    Raises ``ValueError`` for a group of fewer than two samples or a non-finite reward.
    """
    _check_group(rewards_G)
    values = rewards_G if targets is None else targets
    if max(rewards_G) == min(rewards_G):
        return [0.0] * len(values)
    size = len(rewards_G)
    mean = math.fsum(rewards_G) / size
    std = math.sqrt(math.fsum((float(r) - mean) ** 2 for r in rewards_G) / (size - 1))
    scale = 1.0 / (std + STD_EPSILON) if scale_by_std else 1.0
    return [(float(v) - mean) * scale for v in values]


def credited_advantages(
    rewards_G: list[float],
    completion_S: list[int],
    rewards_S: list[float],
    return_weights_S: list[float],
    scale_by_std: bool = True,
) -> list[float]:
    """Per-sample advantages with per-call credit (the formula in the module docstring).

    ``rewards_G``: each completion's return R_c; ``completion_S[s]``: the position in ``rewards_G``
    of sample s's completion; ``rewards_S[s]``: its own reward r_s; ``return_weights_S[s]``: g_s.
    """
    if not len(completion_S) == len(rewards_S) == len(return_weights_S):
        raise ValueError(
            f"completion_S, rewards_S, return_weights_S: lengths {len(completion_S)}, "
            f"{len(rewards_S)}, {len(return_weights_S)} differ"
        )
    episode_G = group_advantages(rewards_G, scale_by_std)
    calls_S = [float(r) - g * float(rewards_G[c]) for c, r, g in zip(completion_S, rewards_S, return_weights_S)]
    for s, value in enumerate(calls_S):
        if not math.isfinite(value):
            raise ValueError(f"rewards_S: rewards_S[{s}]={rewards_S[s]!r} is not a finite number")
    mean_call = math.fsum(calls_S) / len(calls_S) if calls_S else 0.0
    return [g * episode_G[c] + (i - mean_call) for c, g, i in zip(completion_S, return_weights_S, calls_S)]
