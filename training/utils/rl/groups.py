"""Prompt groups: run ``rollout_fn`` for one row ``completions_per_prompt`` times and collect.

A failure costs one completion, never the group or the run: an exception, a timeout, a
malformed result and a ``None`` are each counted on the group; the surviving completions
form the group. Segments of a ``RolloutRun`` share their run's reward and advantage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

from training.utils import loop_watch
from training.utils.rl.advantages import group_advantages
from training.utils.rl.rollout import RolloutFn, RolloutRun, RolloutSample, RolloutValidationError, flatten_result

logger = logging.getLogger(__name__)


@dataclass
class PromptGroup:
    """The completions of one row, stamped with the weight version they were submitted under.

    It is what ``dynamic_filter_fn(pg)`` receives: ``pg.rewards`` (one per surviving completion),
    ``pg.row``, ``pg.samples``; it also iterates, indexes and measures as its list of samples.
    """

    position: int
    """The row's position in the run's data order (see ``RowCursor``)."""
    row: dict
    submit_version: int
    samples: list[RolloutSample] = field(default_factory=list)
    """Every trainable sequence (a ``RolloutRun`` contributes all its segments)."""
    completion_index: list[int] = field(default_factory=list)
    """For each sample, which completion (0..n-1) it came from."""
    completion_rewards: dict[int, float] = field(default_factory=dict)
    """Reward of each surviving completion."""
    advantages: list[float] = field(default_factory=list)
    """One advantage per sample (its completion's), set by ``compute_advantages``."""
    metadata: dict[int, dict] = field(default_factory=dict)
    """``RolloutRun.metadata`` of each completion that returned a run (written to rollouts.jsonl)."""
    errors: int = 0
    timeouts: int = 0
    invalid: int = 0
    dropped: int = 0
    """Completions for which ``rollout_fn`` returned None."""
    rollout_seconds: float = 0.0

    @property
    def attempts(self) -> int:
        return len(self.completion_rewards) + self.errors + self.timeouts + self.invalid + self.dropped

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.invalid

    @property
    def rewards(self) -> list[float]:
        """Reward of each surviving completion, in completion order (a ``RolloutRun`` counts once)."""
        return [self.completion_rewards[k] for k in sorted(self.completion_rewards)]

    def __iter__(self) -> Iterator[RolloutSample]:
        return iter(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> RolloutSample:
        return self.samples[index]

    def compute_advantages(self, scale_by_std: bool = True) -> None:
        """Each sample's reward normalised by the group's completion rewards (a segment of a
        ``segment_rewards`` run keeps its own reward; every other sample's is its completion's)."""
        rewards_G = [self.completion_rewards[k] for k in sorted(self.completion_rewards)]
        self.advantages = group_advantages(rewards_G, scale_by_std, targets=[s.reward for s in self.samples])


async def run_group(rollout_fn: RolloutFn, row: dict, position: int, submit_version: int, n: int,
                    timeout_s: float, semaphore: asyncio.Semaphore, vocab_size: Optional[int] = None,
                    is_retryable: Callable[[BaseException], bool] = lambda e: False) -> PromptGroup:
    """Run ``n`` completions of ``row`` concurrently (each under ``semaphore``) into a group.

    An exception for which ``is_retryable`` is true (a deployment that went away or answered
    5xx past the sampler's own retries) is retried once; every other failure costs that completion.
    """
    group = PromptGroup(position=position, row=row, submit_version=submit_version)
    t0 = time.perf_counter()

    async def one(k: int):
        async with semaphore:
            for attempt in (0, 1):
                try:
                    return k, await loop_watch.wait_for(rollout_fn(row), timeout_s)
                except asyncio.CancelledError:
                    raise
                except BaseException as e:  # noqa: BLE001 - every failure is counted, none kills the run
                    if attempt == 1 or isinstance(e, asyncio.TimeoutError) or not is_retryable(e):
                        return k, e
                    logger.warning("rollout of row %d hit %r; retrying once", position, e)

    for k, result in await asyncio.gather(*(one(k) for k in range(n))):
        if isinstance(result, asyncio.TimeoutError):
            group.timeouts += 1
            logger.warning("rollout of row %d timed out after %.1f s", position, timeout_s)
            continue
        if isinstance(result, BaseException):
            group.errors += 1
            logger.warning("rollout of row %d raised %s: %s", position, type(result).__name__, result)
            continue
        try:
            samples = flatten_result(result, vocab_size)
        except (RolloutValidationError, TypeError) as e:
            group.invalid += 1
            logger.warning("rollout of row %d returned an invalid result: %s", position, e)
            continue
        if not samples:
            group.dropped += 1
            continue
        if isinstance(result, RolloutRun) and result.metadata:
            group.metadata[k] = result.metadata
        group.completion_rewards[k] = float(result.reward if isinstance(result, RolloutRun) else samples[0].reward)
        group.samples.extend(samples)
        group.completion_index.extend([k] * len(samples))
    group.rollout_seconds = time.perf_counter() - t0
    return group
