"""Filters for ``dynamic_filter_fn``: which prompt groups carry something to learn.

``has_learning_signal(pg)`` is the filter to use: it is True when the group's samples would get
different advantages, i.e. when training on it moves the policy. It sees per-call credit (a
``RolloutRun`` with ``segment_rewards``, e.g. the proxy's transitions mode): a group whose
episode returns are all equal can still give its calls different advantages, and such a group
is kept. ``len(set(pg.rewards)) > 1`` looks only at the returns and drops it (its row is then
marked done and never trained).
"""

from __future__ import annotations

import math

from training.utils.rl.groups import PromptGroup

SIGNAL_TOLERANCE = 1e-9
"""Advantages closer together than this count as equal (floating-point noise of the centring)."""


def sample_advantages(pg: PromptGroup) -> list:
    """The advantage each sample of ``pg`` would train with (Dr. GRPO centring; the std scaling does
    not change which groups have any), without touching ``pg``: a float, or a per-token list for a sample
    with ``token_advantages``."""
    if len(pg.completion_rewards) < 2 or not pg.samples:
        return [0.0] * len(pg.samples)
    probe = PromptGroup(
        position=pg.position,
        row=pg.row,
        submit_version=pg.submit_version,
        samples=pg.samples,
        completion_index=pg.completion_index,
        return_weights=pg.return_weights,
        completion_rewards=pg.completion_rewards,
    )
    probe.compute_advantages(scale_by_std=False)
    return probe.advantages


def has_learning_signal(pg: PromptGroup) -> bool:
    """True when some sample's advantage differs from another's or from 0: the group trains the policy.

    Use as ``Config(dynamic_filter_fn=has_learning_signal)``. Equal returns with different per-call
    rewards count as signal; a group of identical rewards (and no per-call credit) does not. The
    advantages judged are the group's own once they are set (``pg.advantages``, one per sample): with
    distillation the recipe runs the filter after the teacher has scored the group, so they are the
    per-token A_t = kl_coef·(log π_t − log π_s) + task_reward_coef·Â, and a group of equal rewards
    whose tokens the teacher disagrees with has signal (it is kept: that is where distillation teaches)."""
    values = []
    set_ = len(pg.advantages) == len(pg.samples) and bool(pg.samples)
    for sample, a in zip(pg.samples, pg.advantages if set_ else sample_advantages(pg)):
        values += [v for v, m in zip(a, sample.loss_mask) if m] if isinstance(a, list) else [a]
    return any(not math.isclose(v, 0.0, abs_tol=SIGNAL_TOLERANCE) for v in values)
