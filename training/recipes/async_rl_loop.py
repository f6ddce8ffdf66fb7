"""``async_rl_loop``: rollouts and training overlap, bounded by the off-policy gate.

    from training.recipes.async_rl_loop import Config, main
    main(Config(base_model=...), rollout_fn_factory=make_rollout_fn, rows="data.jsonl")

Phases of ``main``:
1. set-up: load rows, the trainer (resume from the newest checkpoint in ``log_path``), start
   or attach the deployment, call ``make_rollout_fn(setup)`` once;
2. a producer task submits prompt groups whenever the gate allows (``OffPolicyGate``),
   stamping each with the deployed weight version;
3. each step: wait for ``prompt_groups_per_step`` fresh groups (stale ones are dropped and
   counted), train on them in a worker thread while the producer keeps sampling, push the
   new weights every ``weight_sync_interval`` steps, evaluate, checkpoint, log;
4. finish: final checkpoint and HF export, stop the deployment.

``synchronous_training=True`` drains in-flight rollouts before every step and submits nothing
while training; ``max_head_offpolicy_versions=0`` is strict on-policy.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Optional

from training.recipes.common import RolloutFnFactory, RunContext, batch_metrics
from training.utils import dist as dist_utils
from training.recipes.config import Config
from training.utils.data import Rows
from training.utils.rl.gate import OffPolicyGate
from training.utils.rl.groups import PromptGroup
from training.utils.rl.ppo import train_on_groups

__all__ = ["Config", "main"]

logger = logging.getLogger("training.recipe")


class BusyClock:
    """Seconds during which at least one rollout was in flight (for perf/overlap_fraction)."""

    def __init__(self):
        self.in_flight = 0
        self.total = 0.0
        self._since: Optional[float] = None

    def start(self) -> None:
        if self.in_flight == 0:
            self._since = time.perf_counter()
        self.in_flight += 1

    def stop(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._since is not None:
            self.total += time.perf_counter() - self._since
            self._since = None

    def read(self) -> float:
        extra = time.perf_counter() - self._since if self._since is not None else 0.0
        return self.total + extra


class AsyncRLLoop:
    """The overlapped loop: one producer task, one consumer (``run``)."""

    def __init__(self, ctx: RunContext):
        self.ctx = ctx
        cfg = ctx.cfg
        self.gate = OffPolicyGate(cfg.max_head_offpolicy_versions, cfg.prompt_groups_per_step)
        self.deployed_version = ctx.start_step
        self.assembling_step = ctx.start_step
        self.training = False
        self.ready: list[PromptGroup] = []
        self.in_flight = 0
        self.producer_done = False
        self.changed = asyncio.Event()
        self.busy = BusyClock()
        self.tasks: set[asyncio.Task] = set()
        self.failure: Optional[BaseException] = None
        """An error raised while accepting a group; the consumer re-raises it."""

    # ---- producer -------------------------------------------------------------------------
    def may_submit(self) -> bool:
        cfg = self.ctx.cfg
        if cfg.synchronous_training and self.training:
            return False
        return self.gate.can_submit(self.deployed_version, self.assembling_step, len(self.ready) + self.in_flight)

    async def produce(self) -> None:
        while True:
            if not self.may_submit():
                self.changed.clear()
                await self.changed.wait()
                continue
            position = self.ctx.cursor.take()
            if position is None:
                break
            self.in_flight += 1
            self.busy.start()
            task = asyncio.create_task(self.ctx.run_group(position, self.deployed_version))
            self.tasks.add(task)
            task.add_done_callback(self.on_group_done)
        self.producer_done = True
        self.changed.set()

    def on_group_done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        self.in_flight -= 1
        self.busy.stop()
        if task.cancelled():
            return
        if task.exception() is not None:
            self.failure = task.exception()
        else:
            try:
                if self.ctx.accept_group(task.result()):
                    self.ready.append(task.result())
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer, which stops the run
                self.failure = e
        self.changed.set()

    # ---- consumer -------------------------------------------------------------------------
    async def collect_batch(self, step: int) -> list[PromptGroup]:
        """Wait for ``prompt_groups_per_step`` groups fresh enough for ``step``; drop stale ones."""
        cfg = self.ctx.cfg
        need = cfg.prompt_groups_per_step
        bound = cfg.rollout_timeout_s + 120.0
        last_progress = time.perf_counter()
        while True:
            if self.failure is not None:
                raise self.failure
            kept = []
            for g in self.ready:
                if self.gate.is_fresh(g.submit_version, step):
                    kept.append(g)
                else:
                    self.gate.admit(g.submit_version, step, len(g.samples))  # counts the drop
                    self.ctx.cursor.mark_done(g.position)
            self.ready = kept
            drained = not (cfg.synchronous_training and self.in_flight > 0)
            exhausted = self.producer_done and self.in_flight == 0
            if (len(self.ready) >= need and drained) or (exhausted and self.ready):
                batch, self.ready = self.ready[:need], self.ready[need:]
                for g in batch:
                    self.gate.admit(g.submit_version, step, len(g.samples))
                return batch
            if exhausted:
                return []
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), timeout=5.0)
                last_progress = time.perf_counter()
            except asyncio.TimeoutError:
                if time.perf_counter() - last_progress > bound:
                    raise RuntimeError(f"no rollout finished for {bound:.0f} s (in flight: {self.in_flight}); "
                                       "is the deployment alive? see deployment.log") from None

    async def run(self) -> dict[str, Any]:
        ctx, cfg = self.ctx, self.ctx.cfg
        metrics_log = ctx.open_metrics()
        if ctx.start_step > 0 or not ctx.deployments:
            await ctx.sync_weights(ctx.start_step)  # a resumed run, or a server we did not start
        producer = asyncio.create_task(self.produce())
        last: dict[str, float] = {}
        step = ctx.start_step
        try:
            if ctx.eval_due(step):
                metrics_log.log(step, await ctx.evaluate())
            while step < ctx.total_steps:
                t_step = time.perf_counter()
                busy0 = self.busy.read()
                batch = await self.collect_batch(step)
                if not batch:
                    logger.info("rows exhausted after %d steps", step)
                    break
                t_wait = time.perf_counter() - t_step
                self.assembling_step = step + 1
                self.training = True
                self.changed.set()
                m = batch_metrics(batch)
                m.update(self.gate.step_metrics())
                m.update(ctx.take_counters())
                t_train0 = time.perf_counter()
                busy_train0 = self.busy.read()
                m.update(await asyncio.to_thread(
                    train_on_groups, ctx.trainer, batch, cfg.loss, reference=ctx.reference,
                    ppo_epochs=cfg.ppo_epochs, ppo_mini_batches=cfg.ppo_mini_batches,
                    temperature=cfg.temperature, seed=cfg.seed + step))
                train_s = time.perf_counter() - t_train0
                sync_s = 0.0
                if (step + 1) % cfg.weight_sync_interval == 0:
                    sync_s = await ctx.sync_weights(step + 1)
                    self.deployed_version = step + 1
                self.training = False
                self.changed.set()
                hidden = self.busy.read() - busy_train0
                step += 1
                evals, ckpt_s = await ctx.finish_step(batch, step)
                m.update(evals)
                step_s = time.perf_counter() - t_step
                rollout_busy = self.busy.read() - busy0
                m.update({
                    "perf/step_time_s": step_s, "perf/wait_rollout_s": t_wait, "perf/train_s": train_s,
                    "perf/weight_sync_s": sync_s, "perf/checkpoint_s": ckpt_s,
                    "perf/generated_tokens_per_s": m["rollout/generated_tokens"] / max(step_s, 1e-9),
                    "perf/trained_tokens_per_s": m["train/tokens"] / max(train_s, 1e-9),
                    "perf/overlap_fraction": min(1.0, hidden / max(min(train_s + sync_s, rollout_busy), 1e-9)),
                    "offpolicy/weight_version": float(self.deployed_version),
                })
                metrics_log.log(step - 1, m)
                metrics_log.log_rollouts(step - 1, batch)
                last = m
        finally:
            producer.cancel()
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(producer, *self.tasks, return_exceptions=True)
            metrics_log.close()
        if cfg.dcp_save_interval > 0 and step > ctx.start_step and not ctx.checkpoint_due(step):
            ctx.save_checkpoint(step)
        return {"steps": step, "last_metrics": last}


async def _amain(ctx: RunContext, loop_cls) -> dict[str, Any]:
    try:
        ctx.start_deployment()
        result = await loop_cls(ctx).run()
    finally:
        await ctx.sampler_close()
    final = ctx.finish()
    result["final_model"] = str(final) if final else None
    return result


def run_recipe(loop_cls, cfg: Config, rollout_fn_factory: RolloutFnFactory, rows: Rows,
               rollout_extras: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Build the run context, run ``loop_cls`` to the end, always stop the deployment.

    Under ``torchrun`` (see ``training/trainer/distributed.py``) every rank builds the sharded
    trainer; rank 0 runs the loop and releases the other ranks when it ends (also on errors);
    the others follow it and return ``{"steps": <rank 0's steps>, "last_metrics": {},
    "final_model": None}``.
    """
    started = dist_utils.init_distributed(cfg.trainer.device)
    main_rank = dist_utils.is_main_rank()
    level = logging.INFO if main_rank else logging.WARNING
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    steps = 0
    try:
        ctx = RunContext(cfg, rows, rollout_fn_factory, rollout_extras)
        try:
            ctx.build_trainer()
            if not main_rank:
                return {"steps": ctx.follow(), "last_metrics": {}, "final_model": None}
            result = asyncio.run(_amain(ctx, loop_cls))
            steps = result["steps"]
            return result
        finally:
            ctx.close()
            dist_utils.stop_followers(steps)
    finally:
        if started:
            dist_utils.shutdown_distributed()


def main(cfg: Config, rollout_fn_factory: RolloutFnFactory, rows: Rows,
         rollout_extras: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """Train with overlapped rollouts; returns ``{"steps", "last_metrics", "final_model"}``."""
    return run_recipe(AsyncRLLoop, cfg, rollout_fn_factory, rows, rollout_extras)
