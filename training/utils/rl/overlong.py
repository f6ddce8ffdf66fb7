"""Overlong shaping (DAPO, Yu et al. 2025): completions near or past a length limit are punished softly, and those
the engine cut off may be kept out of training.

With L the completion's generated length (its samples' trainable tokens), ``L_max = max_tokens`` and
``L_c = buffer_tokens``, the soft overlong punishment added to the completion's reward is::

    R_len(L) = 0                              if L <= L_max - L_c
             = ((L_max - L_c) - L) / L_c      if L_max - L_c < L <= L_max
             = -1                             if L > L_max

times ``penalty``. ``filter_truncated`` removes a completion the engine stopped for length (a sample whose
``finish_reason`` is ``"length"``) from its group before advantages, as if its rollout had returned None: it neither
trains nor enters the group's baseline (DAPO masks the loss of truncated samples), counted in
``rollout/overlong_filtered``. Applied by ``RunContext.run_group`` after ``group_reward_fn`` (a judge's scores are
shaped too), before the group is counted, filtered and given advantages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from training.utils.config import ConfigError
from training.utils.rl.groups import PromptGroup


@dataclass
class OverlongConfig:
    """DAPO's overlong reward shaping and filtering (``Config.overlong``); off at the defaults."""

    max_tokens: Optional[int] = None
    """L_max: the length past which a completion gets the full penalty (-penalty); None = no soft punishment.
    Usually the sampling ``max_tokens``."""
    buffer_tokens: int = 0
    """L_c: the window below ``max_tokens`` in which the penalty grows linearly from 0 to -penalty (0 = only past
    ``max_tokens``)."""
    penalty: float = 1.0
    """Scale of the punishment (the reward of a completion longer than ``max_tokens`` drops by this much)."""
    filter_truncated: bool = False
    """Keep completions the engine cut off for length (``finish_reason == "length"``) out of training."""

    def __post_init__(self):
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise ConfigError(f"overlong.max_tokens: must be an int >= 1 or None, got {self.max_tokens!r}")
        if not isinstance(self.buffer_tokens, int) or self.buffer_tokens < 0:
            raise ConfigError(f"overlong.buffer_tokens: must be an int >= 0, got {self.buffer_tokens!r}")
        if self.max_tokens is not None and self.buffer_tokens >= self.max_tokens:
            raise ConfigError(
                f"overlong.buffer_tokens: must be < overlong.max_tokens={self.max_tokens}, got {self.buffer_tokens}"
            )
        if not self.penalty >= 0:
            raise ConfigError(f"overlong.penalty: must be >= 0, got {self.penalty!r}")

    @property
    def enabled(self) -> bool:
        return self.max_tokens is not None or self.filter_truncated


def length_penalty(length: int, max_tokens: int, buffer_tokens: int) -> float:
    """R_len(L) of the module docstring, in [-1, 0]."""
    if length > max_tokens:
        return -1.0
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    return (start - length) / buffer_tokens


def apply_overlong(group: PromptGroup, cfg: OverlongConfig) -> int:
    """Shape the rewards of ``group``'s surviving completions and drop its truncated ones, as ``cfg`` says (module
    docstring). Each sample of a shaped completion moves with it (``PromptGroup.set_completion_reward``: a per-call
    reward keeps its per-call part) and ``rollouts.jsonl`` shows the reward trained on. Returns how many completions
    were filtered out."""
    if not cfg.enabled:
        return 0
    by_completion: dict[int, list[int]] = {}
    for i, k in enumerate(group.completion_index):
        by_completion.setdefault(k, []).append(i)
    filtered = 0
    for k, indices in by_completion.items():
        if k not in group.completion_rewards:
            continue
        samples = [group.samples[i] for i in indices]
        if cfg.filter_truncated and any(s.finish_reason == "length" for s in samples):
            del group.completion_rewards[k]
            filtered += 1
            continue
        if cfg.max_tokens is not None:
            length = sum(s.num_trainable_tokens for s in samples)
            penalty = cfg.penalty * length_penalty(length, cfg.max_tokens, cfg.buffer_tokens)
            group.set_completion_reward(k, group.completion_rewards[k] + penalty)
    if filtered:
        keep = [i for i, k in enumerate(group.completion_index) if k in group.completion_rewards]
        group.samples = [group.samples[i] for i in keep]
        group.completion_index = [group.completion_index[i] for i in keep]
        if group.return_weights:
            group.return_weights = [group.return_weights[i] for i in keep]
        group.overlong_filtered += filtered
    return filtered
