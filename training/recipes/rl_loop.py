"""``rl_loop``: the synchronous on-policy scaffold. Sample a batch, score, step, sync, repeat.

    from training.recipes.rl_loop import Config, main

Each step submits ``prompt_groups_per_step`` rows (topping up when groups are filtered or
fail), waits for all of them, trains, pushes the new weights, and only then samples again.
It shares every piece with ``async_rl_loop`` (``RunContext``, groups, the PPO step); read it
first to see the whole algorithm in one screen.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from training.recipes.async_rl_loop import run_recipe
from training.recipes.common import RolloutFnFactory, RunContext, batch_metrics
from training.recipes.config import Config
from training.utils.data import Rows
from training.utils.rl.ppo import train_on_groups

__all__ = ["Config", "main"]


class SyncRLLoop:
    def __init__(self, ctx: RunContext):
        self.ctx = ctx

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
        ctx, cfg = self.ctx, self.ctx.cfg
        metrics_log = ctx.open_metrics()
        step, last = ctx.start_step, {}
        if step > 0 or not ctx.deployments:
            await ctx.sync_weights(step)  # a resumed run, or a server we did not start
        if ctx.eval_due(step):
            metrics_log.log(step, await ctx.evaluate())
        try:
            while step < ctx.total_steps:
                t0 = time.perf_counter()
                batch = await self.sample_batch(step)
                if not batch:
                    break
                t_rollout = time.perf_counter() - t0
                m = batch_metrics(batch)
                m.update(ctx.take_counters())
                t1 = time.perf_counter()
                m.update(await asyncio.to_thread(
                    train_on_groups, ctx.trainer, batch, cfg.loss, reference=ctx.reference,
                    ppo_epochs=cfg.ppo_epochs, ppo_mini_batches=cfg.ppo_mini_batches,
                    temperature=cfg.temperature, seed=cfg.seed + step))
                t_train = time.perf_counter() - t1
                sync_s = await ctx.sync_weights(step + 1)
                step += 1
                evals, ckpt_s = await ctx.finish_step(batch, step)
                m.update(evals)
                m.update({"perf/step_time_s": time.perf_counter() - t0, "perf/wait_rollout_s": t_rollout,
                          "perf/train_s": t_train, "perf/weight_sync_s": sync_s, "perf/checkpoint_s": ckpt_s,
                          "perf/trained_tokens_per_s": m["train/tokens"] / max(t_train, 1e-9),
                          "perf/generated_tokens_per_s": m["rollout/generated_tokens"] / max(t_rollout, 1e-9),
                          "perf/overlap_fraction": 0.0, "offpolicy/staleness_mean": 0.0,
                          "offpolicy/staleness_max": 0.0, "offpolicy/weight_version": float(step)})
                metrics_log.log(step - 1, m)
                metrics_log.log_rollouts(step - 1, batch)
                last = m
        finally:
            metrics_log.close()
        if cfg.dcp_save_interval > 0 and step > ctx.start_step and not ctx.checkpoint_due(step):
            ctx.save_checkpoint(step)
        return {"steps": step, "last_metrics": last}


def main(cfg: Config, rollout_fn_factory: RolloutFnFactory, rows: Rows,
         rollout_extras: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train synchronously (sample, step, sync); returns ``{"steps", "last_metrics", "final_model"}``."""
    return run_recipe(SyncRLLoop, cfg, rollout_fn_factory, rows, rollout_extras)
