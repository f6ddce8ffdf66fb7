"""``rl_loop``: the synchronous on-policy scaffold. Sample a batch, score, step, sync, repeat.

    from training.recipes.rl_loop import Config, main

Each step submits ``prompt_groups_per_step`` rows (topping up when groups are filtered or
fail), waits for all of them, has the distillation teacher score them when there is one, trains, pushes the new weights (every ``weight_sync_interval``
steps), and only then samples again. It shares every piece with ``async_rl_loop``
(``RunContext``, groups, the PPO step, ``run_recipe``); read it first to see the whole
algorithm in one screen.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Optional

from training.recipes.config import Config
from training.recipes.context import RunContext
from training.recipes.run import RolloutFnFactory, run_recipe
from training.recipes.step_metrics import StepTimer, batch_metrics
from training.utils.data import Rows
from training.utils.rl.step_advantages import set_step_advantages

logger = logging.getLogger("training.recipe")

__all__ = ["Config", "main"]


class SyncRLLoop:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx

    @staticmethod
    def overlaps(cfg: Config) -> bool:
        """Rollouts never run while the trainer trains."""
        return False

    async def sample_batch(self, version: int) -> list:
        """Groups for one step, all sampled under ``version``; fewer only when the rows run out."""
        ctx, need = self.ctx, self.ctx.cfg.prompt_groups_per_step
        batch: list = []
        while len(batch) < need:
            positions = [p for p in (ctx.cursor.take() for _ in range(need - len(batch))) if p is not None]
            if not positions:
                break
            groups = await asyncio.gather(*(ctx.run_group(p, version) for p in positions))
            batch.extend(g for g in groups if ctx.accept_group(g))
        return batch

    async def run(self) -> dict[str, Any]:
        ctx = self.ctx
        await ctx.start_run()
        step, last = ctx.start_step, {}
        deployed_version = step
        while step < ctx.total_steps:
            timer = StepTimer()
            with timer.phase("wait_rollout"):
                batch = await self.sample_batch(deployed_version)
            if not batch:
                break
            m = {**batch_metrics(batch), **ctx.take_counters()}
            staleness = float(step - deployed_version)
            set_step_advantages(batch, ctx.cfg.advantage_estimator)  # the estimator, over the whole step
            if ctx.teacher is not None:  # on-policy distillation: per-token advantages, then the filter
                with timer.phase("teacher"):
                    batch, distilled = await ctx.distill(batch)
                    m.update(distilled)
                if not batch:
                    logger.info("step %d: dynamic_filter_fn dropped every scored group; sampling again", step)
                    continue
            async with ctx.colocated(timer) as colocate:
                with timer.phase("train"):
                    m.update(await ctx.train(batch, step))
                with timer.phase("weight_sync"):
                    if ctx.sync_due(step + 1):
                        await ctx.sync_weights(step + 1)
                        deployed_version = step + 1
            m.update(colocate)
            step += 1
            m.update(await ctx.finish_step(batch, step, timer))
            m.update(timer.metrics(m))
            m.update(
                {
                    "perf/overlap_fraction": 0.0,
                    "offpolicy/staleness_mean": staleness,
                    "offpolicy/staleness_max": staleness,
                    "offpolicy/weight_version": float(deployed_version),
                }
            )
            ctx.log_step(step - 1, m, batch)
            await ctx.checkpoint_step(step)  # after the log: a kill in between trains the step again
            last = m
        ctx.finish_run(step)
        return {"steps": step, "last_metrics": last}


def main(
    cfg: Config,
    rollout_fn_factory: Optional[RolloutFnFactory] = None,
    rows: Optional[Rows] = None,
    rollout_extras: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Train synchronously (sample, step, sync); returns ``{"steps", "last_metrics", "final_model", "output_model",
    "log_path"}`` (``log_path``: the folder the run wrote to, see ``if_log_path_exists``).

    ``main(cfg)`` alone reads ``cfg.dataset`` (at most ``cfg.max_rows`` rows) and runs the built-in single-turn
    rollout, scored by ``cfg.reward_fn`` (default: exact match against the row's ``answer``)."""
    return run_recipe(SyncRLLoop, cfg, rollout_fn_factory, rows, rollout_extras)
