"""One model on one task: start the embedded server the recipes start, build the rollout, score every row.

``evaluate_model(target, task, settings, work_dir)``:

1. the weights to serve (``models.materialize``: a folder, a hub id, or a run's checkpoint exported once);
2. ``DeploymentGroup(model, DeployConfig(...)).start(tokenizer)``: the same server and sampler a run uses,
   its engine seeded with ``settings.seed``;
3. ``make_rollout_fn(RolloutSetup(...))`` once, checked like a run's (``check_rollout_fn``);
4. ``score_rows(..., samples=settings.n, seed=settings.seed)`` (``training/utils/rl/eval_rollouts.py``, the
   scoring the recipes' eval uses): completion ``k`` of row ``i`` samples under seeds derived from
   ``(seed, i, k)``, so a rerun, or another model given the same seed, draws the same seeds.

The server is stopped whatever happens.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from training.eval.models import Target, materialize
from training.eval.tasks import EvalTask
from training.utils.rl.eval_rollouts import RowScores

logger = logging.getLogger("training.eval")


@dataclass(frozen=True)
class EvalSettings:
    """How every model of one evaluation is sampled (the same for both sides of a comparison)."""

    n: int = 1
    """Samples per prompt."""
    seed: int = 0
    """Request seeds derive from it, with the row and sample index; also the engine's seed."""
    temperature: float = 1.0
    max_tokens: int = 256
    max_concurrency: int = 64
    """Rollouts in flight at once (a run's ``Config.max_concurrency``)."""
    timeout_s: float = 600.0
    """A rollout running longer scores 0 and counts as failed (a run's ``Config.rollout_timeout_s``)."""
    device: str = "auto"
    """The engine's device (``EngineConfig.device``)."""
    max_model_len: int = 2048
    """Longest prompt + completion (``EngineConfig.max_model_len``)."""

    def describe(self) -> dict:
        return dataclasses.asdict(self)


def evaluate_model(target: Target, task: EvalTask, settings: EvalSettings, work_dir: Path, label: str) -> RowScores:
    """Serve ``target``, roll out ``task`` ``settings.n`` times per row; the server log is ``work_dir/server-<label>.log``."""
    from transformers import AutoTokenizer

    from training.deployment.group import DeploymentGroup
    from training.utils.config import DeployConfig, EngineConfig

    work_dir.mkdir(parents=True, exist_ok=True)
    model = materialize(target, work_dir / f"weights-{label}")
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = EngineConfig(seed=settings.seed, device=settings.device, max_model_len=settings.max_model_len)
    dcfg = DeployConfig(engine_config=engine, log_file=str(work_dir / f"server-{label}.log"))
    logger.info("%s: serving %s (server log %s)", label, model, dcfg.log_file)
    group = DeploymentGroup(model, dcfg).start(tokenizer)
    try:
        return asyncio.run(_score(group, tokenizer, task, settings, engine.max_model_len))
    finally:
        group.stop()


async def _score(group, tokenizer, task: EvalTask, settings: EvalSettings, max_seq_len: Optional[int]) -> RowScores:
    from training.utils.rl.eval_rollouts import score_rows
    from training.utils.rl.failure_log import FailureLog
    from training.utils.rl.rollout import RolloutSetup, check_rollout_fn

    try:
        setup = RolloutSetup(
            sampler=group.sampler,
            tokenizer=tokenizer,
            sampling_kwargs={"max_tokens": settings.max_tokens, "temperature": settings.temperature},
            max_seq_len=max_seq_len,
        )
        rollout_fn = task.make_rollout_fn(setup)
        check_rollout_fn(rollout_fn)
        return await score_rows(
            rollout_fn,
            task.rows,
            semaphore=asyncio.Semaphore(settings.max_concurrency),
            timeout_s=settings.timeout_s,
            failure_log=FailureLog("eval rollout"),
            samples=settings.n,
            seed=settings.seed,
        )
    finally:
        await group.close_sampler()
