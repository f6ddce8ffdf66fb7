"""Scoring eval rows: every row rolled out ``samples`` times, each completion's reward, failures scored 0.

``score_rows`` is the one scoring path of an evaluation: ``RunContext.evaluate`` (the recipes' periodic
eval, one sample per row) and ``python -m training.eval`` (``samples`` per row, seeded) both call it.

A failed rollout (it raised, ran past ``timeout_s``, or returned something ``result_reward`` refuses: not
a ``RolloutSample`` / ``RolloutRun`` / None, or a reward the contract refuses) scores 0.0 and is reported
through ``failure_log`` naming the row (the first of each kind with its traceback); a rollout that
returns None (it dropped the row) scores 0.0 without counting as a failure.

With ``seed`` set, completion ``k`` of row ``i`` runs in ``seed_scope(seed, i, k)``
(``request_seeds.py``): its requests carry seeds derived from those three numbers, so the same seed
samples the same tokens from the same weights whatever else is in flight, and two models evaluated with
one seed see the same seeds. Without it requests keep the server's own seed stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

from training.utils.aio import loop_watch
from training.utils.rl.failure_log import FailureLog, row_label
from training.utils.rl.request_seeds import seed_scope
from training.utils.rl.rollout import RolloutFn, RolloutValidationError, result_reward

logger = logging.getLogger("training.recipe")


@dataclass
class RowScores:
    """The rewards of an evaluation, ``rewards_RS[row][sample]``, and which completions failed."""

    rewards_RS: list[list[float]]
    """Per row, its ``samples`` rewards (a failed completion's is 0.0)."""
    failed: list[tuple[int, int]]
    """``(row, sample)`` of every failed completion, sorted."""

    @property
    def flat_rewards(self) -> list[float]:
        """Every reward, row by row."""
        return [r for row in self.rewards_RS for r in row]


async def score_rows(
    rollout_fn: RolloutFn,
    rows: list[dict],
    *,
    semaphore: asyncio.Semaphore,
    timeout_s: float,
    failure_log: FailureLog,
    samples: int = 1,
    seed: Optional[int] = None,
) -> RowScores:
    """Roll out every row ``samples`` times (at most ``semaphore`` at once); see the module docstring."""
    if samples < 1:
        raise ValueError(f"samples: must be >= 1, got {samples}")

    async def one(index: int, row: dict, k: int) -> Optional[float]:
        label = row_label(row, index)
        scope = seed_scope(seed, index, k) if seed is not None else contextlib.nullcontext()
        async with semaphore:
            try:
                with scope:
                    result = await loop_watch.wait_for(rollout_fn(row), timeout_s)
                reward = result_reward(result)
            except RolloutValidationError as e:
                failure_log.problem(label, "invalid_" + e.field, f"returned an invalid result: {e}")
            except asyncio.TimeoutError:
                failure_log.problem(label, "timeout", "timed out (rollout_timeout_s); it scores 0")
            except Exception as e:  # noqa: BLE001 - an eval failure scores 0, never stops the run
                failure_log.exception(label, e)
            else:
                return 0.0 if reward is None else reward  # None: the rollout dropped the row
        return None

    pairs = [(i, k) for i in range(len(rows)) for k in range(samples)]
    results = await asyncio.gather(*(one(i, rows[i], k) for i, k in pairs))
    rewards_RS: list[list[float]] = [[] for _ in rows]
    failed = []
    for (i, k), reward in zip(pairs, results):
        rewards_RS[i].append(0.0 if reward is None else reward)
        if reward is None:
            failed.append((i, k))
    if failed:
        logger.warning(
            "eval: %d of %d rollouts failed and scored 0 (eval rows %s); see the first of each kind above",
            len(failed),
            len(pairs),
            sorted({i for i, _ in failed})[:10],
        )
    return RowScores(rewards_RS, failed)
