"""``async_rl_loop``: rollouts and training overlap, bounded by the off-policy gate.

    from training.recipes.async_rl_loop import Config, main
    main(Config(base_model=...), rollout_fn_factory=make_rollout_fn, rows="data.jsonl")

Phases of ``main`` (set-up and finish are ``run_recipe``'s, in ``run.py``):
1. set-up: load rows, the trainer (resume from the newest checkpoint in ``log_path``), start
   or attach the deployment, call ``make_rollout_fn(setup)`` once;
2. a producer task submits prompt groups whenever the gate allows (``OffPolicyGate``),
   stamping each with the deployed weight version;
3. each step: collect ``prompt_groups_per_step`` finished groups, oldest-submitted first
   (``OffPolicyGate.plan_batch``: under ``stale_policy="wait"`` the trainer waits for an older
   running group when the next step would push it past the bound; under ``"drop"`` a late group
   is dropped and its row requeued), set their advantages with ``Config.advantage_estimator`` over the whole step
   (``set_step_advantages``), with a distillation teacher have it score them first
   (``RunContext.distill``: per-token advantages), train on them in the trainer's thread while the producer
   keeps sampling, push the new weights every ``weight_sync_interval`` steps (in flight when
   ``inflight_weight_updates``), evaluate and checkpoint when due, log;
4. finish: final checkpoint and HF export, stop the deployment.

``synchronous_training=True`` drains in-flight rollouts before every step and submits nothing
while training; ``max_head_offpolicy_versions=0`` is strict on-policy; whether rollouts overlap
training is ``Config.rollouts_overlap_training``. ``deployment.colocate`` trains synchronously
(``Config.trains_synchronously``) and wraps train and push in ``RunContext.colocated`` (the replicas
sleep, the trainer trains, the weights are pushed, the replicas wake).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Optional

from training.recipes.config import Config
from training.recipes.context import RunContext
from training.recipes.run import RolloutFnFactory, run_recipe
from training.recipes.step_metrics import StepTimer, batch_metrics
from training.utils.cache import cache_dir
from training.utils.data import Rows
from training.utils.rl.gate import OffPolicyGate
from training.utils.rl.groups import PromptGroup
from training.utils.rl.step_advantages import set_step_advantages

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
        self.gate = OffPolicyGate(cfg.max_head_offpolicy_versions, cfg.prompt_groups_per_step, cfg.stale_policy)
        self.deployed_version = ctx.start_step
        self.assembling_step = ctx.start_step
        self.training = False
        self.ready: list[PromptGroup] = []
        """Finished, accepted groups, oldest-submitted first."""
        self.in_flight = 0
        self.changed = asyncio.Event()
        self.busy = BusyClock()
        self.tasks: dict[asyncio.Task, int] = {}
        """Running groups and the version each was submitted under."""
        self.tickets: dict[int, int] = {}
        """Submission order of each outstanding row position (``ready`` is kept sorted by it)."""
        self.submitted = 0
        self.trainer_wait_s = 0.0
        """Seconds the current step waited for older groups although enough younger ones had finished."""
        self.window_metrics: dict[str, float] = {}
        """``batch_window_metrics`` of the batch last taken."""
        self.failure: Optional[BaseException] = None
        """An error raised while accepting a group; the consumer re-raises it."""
        self.finished = False
        """The last step has trained: nothing more is submitted (its checkpoint is written off the loop meanwhile)."""

    @staticmethod
    def overlaps(cfg: Config) -> bool:
        """Whether rollouts run while the trainer trains: ``Config.rollouts_overlap_training``."""
        return cfg.rollouts_overlap_training

    # ---- producer -------------------------------------------------------------------------
    def may_submit(self) -> bool:
        cfg = self.ctx.cfg
        if (cfg.trains_synchronously and self.training) or self.finished:
            return False
        return self.gate.can_submit(self.deployed_version, self.assembling_step, len(self.ready) + self.in_flight)

    async def produce(self) -> None:
        """Submit groups while the gate allows; idle (never exit) when the rows run out, since a
        dropped group's row may be requeued. Cancelled by ``run`` at the end."""
        while True:
            if not self.may_submit() or not self.ctx.cursor.has_next():
                self.changed.clear()
                await self.changed.wait()
                continue
            position = self.ctx.cursor.take()
            self.in_flight += 1
            self.busy.start()
            self.tickets[position] = self.submitted
            self.submitted += 1
            task = asyncio.create_task(self.ctx.run_group(position, self.deployed_version))
            self.tasks[task] = self.deployed_version
            task.add_done_callback(self.on_group_done)

    def on_group_done(self, task: asyncio.Task) -> None:
        self.tasks.pop(task, None)
        self.in_flight -= 1
        self.busy.stop()
        if task.cancelled():
            return
        if task.exception() is not None:
            self.failure = task.exception()
        else:
            group = task.result()
            try:
                if self.ctx.accept_group(group):
                    self.ready.append(group)
                    self.ready.sort(key=lambda g: self.tickets[g.position])
                else:
                    self.tickets.pop(group.position, None)
            except Exception as e:  # noqa: BLE001 - surfaced to the consumer, which stops the run
                self.failure = e
        self.changed.set()

    # ---- consumer -------------------------------------------------------------------------
    def exhausted(self) -> bool:
        """No group runs and no row is left to submit: the remaining ``ready`` groups are the last."""
        return self.in_flight == 0 and not self.ctx.cursor.has_next()

    def drop_stale(self, step: int) -> None:
        """Drop finished groups past their deadline (only ``drop`` produces them) and requeue their rows."""
        kept = []
        for g in self.ready:
            if self.gate.is_fresh(g.submit_version, step):
                kept.append(g)
            else:
                self.gate.admit(g.submit_version, step, len(g.samples))  # counts the drop
                self.tickets.pop(g.position, None)
                self.ctx.cursor.requeue(g.position)
                self.changed.set()
        self.ready = kept

    async def collect_batch(self, step: int) -> list[PromptGroup]:
        """Wait until ``OffPolicyGate.plan_batch`` releases a batch for ``step``; [] when the rows ran out."""
        cfg = self.ctx.cfg
        need = cfg.prompt_groups_per_step
        last_progress = time.perf_counter()
        self.trainer_wait_s = 0.0
        while True:
            if self.failure is not None:
                raise self.failure
            self.drop_stale(step)
            drained = not (cfg.trains_synchronously and self.in_flight > 0)
            exhausted = self.exhausted()
            plan = None
            if (len(self.ready) >= need and drained) or (exhausted and self.ready):
                running = list(self.tasks.values())
                plan = self.gate.plan_batch(step, [g.submit_version for g in self.ready], running)
            if plan is not None:
                self.window_metrics = self.batch_window_metrics(step, plan)
                batch = [self.ready[i] for i in plan]
                taken = set(plan)
                self.ready = [g for i, g in enumerate(self.ready) if i not in taken]
                for g in batch:
                    self.tickets.pop(g.position, None)
                    self.gate.admit(g.submit_version, step, len(g.samples))
                    for sample in g.samples:
                        self.gate.record_token_versions(step, sample.token_weight_versions)
                return batch
            if exhausted:
                return []
            waiting_for_older = len(self.ready) >= need and drained
            if waiting_for_older and self.trainer_wait_s == 0.0:
                logger.info(
                    "step %d waits for %d older running group(s) so that every group trains within "
                    "max_head_offpolicy_versions=%d",
                    step,
                    self.in_flight,
                    cfg.max_head_offpolicy_versions,
                )
            t0 = time.perf_counter()
            last_progress = await self.ctx.wait_for(self.changed, self.in_flight, last_progress)
            if waiting_for_older:
                self.trainer_wait_s += time.perf_counter() - t0

    def batch_window_metrics(self, step: int, plan: list[int]) -> dict[str, float]:
        """``offpolicy/*`` facts of the batch about to be taken: window, bypasses, occupancy."""
        running = list(self.tasks.values())
        outstanding = [g.submit_version for g in self.ready] + running
        capacity = self.gate.submit_capacity(self.deployed_version, step)
        ready_positions = {g.position for g in self.ready}
        oldest_running = min((t for p, t in self.tickets.items() if p not in ready_positions), default=None)
        bypassed = (
            0
            if oldest_running is None
            else sum(1 for i in plan if self.tickets[self.ready[i].position] > oldest_running)
        )
        return {
            "offpolicy/bypass_window": float(self.gate.bypass_window(step, outstanding)),
            "offpolicy/bypassed_groups": float(bypassed),
            "offpolicy/window_occupancy": len(outstanding) / max(capacity, 1),
            "offpolicy/trainer_wait_s": self.trainer_wait_s,
        }

    async def run(self) -> dict[str, Any]:
        ctx = self.ctx
        await ctx.start_run()
        producer = asyncio.create_task(self.produce())
        last: dict[str, float] = {}
        step = ctx.start_step
        try:
            while step < ctx.total_steps:
                timer = StepTimer()
                busy0 = self.busy.read()
                with timer.phase("wait_rollout"):
                    batch = await self.collect_batch(step)
                if not batch:
                    logger.info("rows exhausted after %d steps", step)
                    break
                self.assembling_step = step + 1
                self.training = True
                self.changed.set()
                m = {**batch_metrics(batch), **self.gate.step_metrics(), **self.window_metrics, **ctx.take_counters()}
                set_step_advantages(batch, ctx.cfg.advantage_estimator)  # the estimator, over the whole step
                if ctx.teacher is not None:  # on-policy distillation: per-token advantages, then the filter
                    with timer.phase("teacher"):
                        batch, distilled = await ctx.distill(batch)
                        m.update(distilled)
                    if not batch:
                        logger.info("step %d: dynamic_filter_fn dropped every scored group; collecting again", step)
                        self.assembling_step, self.training = step, False
                        self.changed.set()
                        continue
                busy_train0 = self.busy.read()
                async with ctx.colocated(timer) as colocate:
                    with timer.phase("train"):
                        m.update(await ctx.train(batch, step))
                    with timer.phase("weight_sync"):
                        if ctx.sync_due(step + 1):
                            await ctx.sync_weights(step + 1)
                            self.deployed_version = step + 1
                m.update(colocate)
                self.training = False
                self.changed.set()
                hidden = self.busy.read() - busy_train0
                step += 1
                m.update(await ctx.finish_step(batch, step, timer))
                m.update(timer.metrics(m))
                busy = min(timer.seconds["train"] + timer.seconds["weight_sync"], self.busy.read() - busy0)
                m["perf/overlap_fraction"] = min(1.0, hidden / max(busy, 1e-9))
                m["offpolicy/weight_version"] = float(self.deployed_version)
                ctx.log_step(step - 1, m, batch)
                self.finished = step >= ctx.total_steps
                await ctx.checkpoint_step(step)  # after the log: a kill in between trains the step again
                last = m
        finally:
            producer.cancel()
            for t in list(self.tasks):
                t.cancel()
            await asyncio.gather(producer, *self.tasks, return_exceptions=True)
        ctx.finish_run(step)
        return {"steps": step, "last_metrics": last}


EXPERIMENTAL_NOTICE = (
    "async_rl_loop is experimental: its Config fields and the rollout contract may still change; "
    "pin a commit if you depend on them (shown once per installation; show_experimental_notice=true shows it always)"
)
NOTICE_MARKER = "async_rl_loop_notice_shown"
"""The file in the cache folder whose presence means the notice was shown on this installation."""


def show_notice(cfg: Config) -> bool:
    """Log ``EXPERIMENTAL_NOTICE`` per ``cfg.show_experimental_notice`` (None: once per installation, marked by
    ``NOTICE_MARKER`` in ``cache_dir()``); only rank 0 logs it. True if it was logged."""
    if os.environ.get("RANK", "0") != "0" or cfg.show_experimental_notice is False:  # before the process group exists
        return False
    marker = cache_dir() / NOTICE_MARKER
    if cfg.show_experimental_notice is None:
        if marker.exists():
            return False
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.write_text("the async_rl_loop experimental notice was shown; delete this file to see it again\n")
        except OSError:
            pass  # a read-only cache: the notice shows on every run
    logger.warning(EXPERIMENTAL_NOTICE)
    return True


def main(
    cfg: Config,
    rollout_fn_factory: Optional[RolloutFnFactory] = None,
    rows: Optional[Rows] = None,
    rollout_extras: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Train with overlapped rollouts; returns ``{"steps", "last_metrics", "final_model", "output_model", "log_path"}``.

    ``rows`` default to ``cfg.dataset``; without ``rollout_fn_factory`` the built-in single-turn rollout runs.
    ``EXPERIMENTAL_NOTICE`` is logged once per installation (``cfg.show_experimental_notice``)."""
    show_notice(cfg)
    return run_recipe(AsyncRLLoop, cfg, rollout_fn_factory, rows, rollout_extras)
