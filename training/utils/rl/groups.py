"""Prompt groups: run ``rollout_fn`` for one row ``completions_per_prompt`` times and collect.

A failure costs one completion, never the group or the run: an exception, a timeout, a
malformed result and a ``None`` are each counted on the group, every failure also under its
cause (``failure_cause``: ``timeout``, ``upstream_5xx``, ``agent``, ``invalid_loss_mask``...);
the surviving completions form the group. Failures are reported through a ``FailureLog`` (the
first of each kind with its traceback, the rest counted), naming the data row (``row_label``).
A failure of the deployment rather than of the rollout (``is_retryable``) is also counted in
``deployment_failures``: the recipe requeues such a group's row instead of training what is left.
One for which ``is_fatal`` is true (a server that cannot come back) is no failed completion: it
is raised, once every completion of the group has ended, and stops the run.
Segments of a ``RolloutRun`` share their run's reward and advantage, unless the run credits each
segment (``segment_rewards``: see ``advantages.py``). A sample with ``token_advantages`` trains with
that per-token list instead of its scalar advantage.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional, Union

from training.utils.aio import loop_watch
from training.utils.rl.advantages import credited_advantages
from training.utils.rl.failure_log import FailureLog, row_label
from training.utils.rl.request_seeds import completion_seed_key, seed_scope
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
    return_weights: list[float] = field(default_factory=list)
    """For each sample, g: the share of its completion's reward it is credited (1 unless per-call credit)."""
    completion_rewards: dict[int, float] = field(default_factory=dict)
    """Reward of each surviving completion."""
    completion_components: dict[int, dict[str, float]] = field(default_factory=dict)
    """``reward_components`` of each completion that returned some (``reward_components.py``); read for the keys
    of ``completion_rewards`` only (a filtered completion's entry may stay)."""
    advantages: list[Union[float, list[float]]] = field(default_factory=list)
    """One advantage per sample, set by ``compute_advantages``: its completion's scalar (the same on every token), or
    a list parallel to its ``tokens`` (A_t; used where ``loss_mask`` is 1): the sample's own ``token_advantages``, or
    what the recipe's distillation builds (``training/utils/rl/distillation.py``)."""
    metadata: dict[int, dict] = field(default_factory=dict)
    """``RolloutRun.metadata`` of each completion that returned a run (written to rollouts.jsonl)."""
    errors: int = 0
    timeouts: int = 0
    invalid: int = 0
    dropped: int = 0
    """Completions for which ``rollout_fn`` returned None."""
    overlong_filtered: int = 0
    """Completions the engine cut off for length, kept out of training (``overlong.filter_truncated``)."""
    failure_causes: dict[str, int] = field(default_factory=dict)
    """Failed completions (errors, timeouts, invalid results) counted by ``failure_cause``."""
    deployment_failures: int = 0
    """Failed completions whose error was the deployment's (``is_retryable``), after their retry: the row is requeued."""
    rollout_seconds: float = 0.0
    row_index: Optional[int] = None
    """The row's index in the user's rows (``RowCursor.row_index(position)``), when known."""

    @property
    def attempts(self) -> int:
        return (
            len(self.completion_rewards)
            + self.errors
            + self.timeouts
            + self.invalid
            + self.dropped
            + self.overlong_filtered
        )

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

    def set_completion_reward(self, k: int, reward: float) -> None:
        """Give completion ``k`` the return ``reward`` (what a judge, the reward components or overlong shaping
        decide): each of its samples moves with it by its share g_s (``return_weights``), so a per-call part
        r_s - g_s·R stays as it was and a plain sample's ``reward`` becomes ``reward`` exactly."""
        old = self.completion_rewards[k]
        weights = self.return_weights or [1.0] * len(self.samples)
        for sample, c, g in zip(self.samples, self.completion_index, weights):
            if c == k:
                per_call = sample.reward - g * old  # 0 unless per-call credit
                sample.reward = g * reward + per_call if per_call else g * reward
        self.completion_rewards[k] = reward

    def compute_advantages(self, scale_by_std: bool = True) -> None:
        """Each sample's advantage from the group's completion rewards (``credited_advantages``: a
        segment of a ``segment_rewards`` run adds its per-call reward; any other sample gets its
        completion's group-normalised reward); a sample with ``token_advantages`` gets that list instead."""
        keys = sorted(self.completion_rewards)
        position = {k: j for j, k in enumerate(keys)}
        rewards_G = [self.completion_rewards[k] for k in keys]
        weights = self.return_weights or [1.0] * len(self.samples)
        self.advantages = credited_advantages(
            rewards_G,
            [position[k] for k in self.completion_index],
            [s.reward for s in self.samples],
            weights,
            scale_by_std,
        )
        for i, sample in enumerate(self.samples):
            if sample.token_advantages is not None:
                self.advantages[i] = [float(a) for a in sample.token_advantages]

    def count_failure(self, cause: str) -> None:
        self.failure_causes[cause] = self.failure_causes.get(cause, 0) + 1


def _metric_name(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.lower()).strip("_") or "unknown"


def failure_cause(error: BaseException) -> str:
    """A short metric-safe name of why a rollout raised (counted as ``rollout/failed/<cause>``).

    The exception's own ``failure_cause`` attribute when it has one (the proxy's
    ``UpstreamFailedError`` says ``upstream``, ``AgentFailedError`` ``agent``); ``timeout`` for
    ``asyncio.TimeoutError``; ``upstream_5xx`` / ``upstream_4xx`` for an exception carrying an HTTP
    ``status`` (the sampler's ``DeploymentRequestError``); ``connection`` for connection errors;
    else ``exception_<class name>``.
    """
    cause = getattr(error, "failure_cause", None)
    if isinstance(cause, str) and cause:
        return _metric_name(cause)
    if isinstance(error, asyncio.TimeoutError):
        return "timeout"
    status = getattr(error, "status", None)
    if isinstance(status, int) and not isinstance(status, bool):
        return "upstream_5xx" if status >= 500 else "upstream_4xx"
    if isinstance(error, ConnectionError) or type(error).__name__.startswith("ClientConnector"):
        return "connection"
    return "exception_" + _metric_name(type(error).__name__)


def _completion_scope(seed: Optional[int], submit_version: int, position: int, k: int):
    if seed is None:
        return contextlib.nullcontext()
    return seed_scope(*completion_seed_key(seed, submit_version, position, k))


async def run_group(
    rollout_fn: RolloutFn,
    row: dict,
    position: int,
    submit_version: int,
    n: int,
    timeout_s: float,
    semaphore: asyncio.Semaphore,
    vocab_size: Optional[int] = None,
    is_retryable: Callable[[BaseException], bool] = lambda e: False,
    row_index: Optional[int] = None,
    failure_log: Optional[FailureLog] = None,
    seed: Optional[int] = None,
    is_fatal: Callable[[BaseException], bool] = lambda e: False,
) -> PromptGroup:
    """Run ``n`` completions of ``row`` concurrently (each under ``semaphore``) into a group.

    An exception for which ``is_retryable`` is true (a deployment that went away or answered
    5xx past the sampler's own retries) is retried once, and if it fails again counted in
    ``deployment_failures``; every failure costs that completion and is reported to ``failure_log``
    (a fresh one when not given), naming ``row_index``. An exception for which ``is_fatal`` is true is
    raised once every completion has ended (the first one, in completion order).
    ``seed`` (the run's): completion ``k`` runs in ``seed_scope(seed, submit_version, position, k)``, so
    its requests sample the same tokens after a server restart (``request_seeds.py``).
    """
    group = PromptGroup(position=position, row=row, submit_version=submit_version, row_index=row_index)
    failures = failure_log if failure_log is not None else FailureLog()
    label = row_label(row, row_index, position)
    t0 = time.perf_counter()

    async def one(k: int):
        async with semaphore:
            for attempt in (0, 1):
                try:
                    with _completion_scope(seed, submit_version, position, k):
                        return k, await loop_watch.wait_for(rollout_fn(row), timeout_s)
                except (asyncio.CancelledError, KeyboardInterrupt, SystemExit):
                    raise  # a stop, never a failed completion
                except BaseException as e:  # noqa: BLE001 - every failure is counted, none kills the run
                    if is_fatal(e):
                        raise
                    if attempt == 1 or isinstance(e, asyncio.TimeoutError) or not is_retryable(e):
                        return k, e
                    logger.warning("rollout of %s hit %r; retrying once", label, e)

    outcomes = await asyncio.gather(*(one(k) for k in range(n)), return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, BaseException):  # a stop or a fatal error, raised once no completion runs
            raise outcome
    for k, result in outcomes:
        if isinstance(result, asyncio.TimeoutError):
            group.timeouts += 1
            group.count_failure("timeout")
            failures.problem(
                label, "timeout", f"timed out after {timeout_s:.1f} s (rollout_timeout_s); that completion is dropped"
            )
            continue
        if isinstance(result, BaseException):
            group.errors += 1
            group.count_failure(failure_cause(result))
            if is_retryable(result):
                group.deployment_failures += 1
            failures.exception(label, result)
            continue
        try:
            samples = flatten_result(result, vocab_size)
        except (RolloutValidationError, TypeError) as e:
            field_name = getattr(e, "field", "type")
            group.invalid += 1
            group.count_failure("invalid_" + _metric_name(field_name))
            failures.problem(label, "invalid_" + field_name, f"returned an invalid result: {e}")
            continue
        if not samples:
            group.dropped += 1
            continue
        if isinstance(result, RolloutRun) and result.metadata:
            group.metadata[k] = result.metadata
        group.completion_rewards[k] = float(result.reward if isinstance(result, RolloutRun) else samples[0].reward)
        if result.reward_components is not None:
            group.completion_components[k] = dict(result.reward_components)
        group.samples.extend(samples)
        group.completion_index.extend([k] * len(samples))
        per_call = isinstance(result, RolloutRun) and result.segment_rewards and result.return_weights is not None
        group.return_weights.extend([float(g) for g in result.return_weights] if per_call else [1.0] * len(samples))
    group.rollout_seconds = time.perf_counter() - t0
    return group
