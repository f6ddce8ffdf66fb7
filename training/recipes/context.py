"""``RunContext``: the parts of one RL run on rank 0 and the operations the loops compose.

``RunContext`` owns the long-lived parts (trainer, reference model, deployment, rollout function,
data cursor, metrics) and the operations on them; a loop owns only the order in which they happen:
collect → ``distill`` (with a teacher) → ``train`` → ``sync_weights`` → ``finish_step`` → ``log_step`` → ``checkpoint_step``. ``RolloutFailureError`` is what
``accept_group`` raises when too many rollouts of a step failed.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from pathlib import Path
from typing import AsyncIterator, Optional

import aiohttp
import torch

from training.deployment.group import DeploymentGroup
from training.deployment.backends.process import DeploymentStartError
from training.deployment.client import DeploymentLostError, DeploymentRequestError
from training.recipes.config import WAIT_POLL_S, Config
from training.recipes.resources import CpuShare
from training.recipes.step_metrics import StepCounters, StepTimer, server_metrics
from training.recipes.teacher import Teacher
from training.recipes.train_state import TrainState
from training.utils.checkpoint import rng_state, save_checkpoint
from training.utils.dist import Command, is_distributed, lead
from training.utils.metrics import MetricsLogger
from training.utils.openmp import release_openmp_threads
from training.utils.rl.group_reward import apply_group_reward, group_reward_metrics
from training.utils.rl.eval_rollouts import score_rows
from training.utils.rl.groups import PromptGroup, run_group
from training.utils.rl.overlong import apply_overlong
from training.utils.rl.mismatch_probe import PROBE_SAMPLES, probe_mismatch
from training.utils.rl.ppo import refreshes_reference, train_on_groups
from training.utils.rl.reward_components import apply_reward_components
from training.utils.rl.failure_log import FailureLog, row_label
from training.utils.rl.rollout import RolloutFn, RolloutSetup

logger = logging.getLogger("training.recipe")


class RolloutFailureError(RuntimeError):
    """Too many rollouts of a step failed: the run stops instead of training on what is left."""


MAX_GROUP_REQUEUES = 3
"""A row whose group failed for a deployment reason this many times in a row stops the run (``accept_group``)."""


def is_fatal(error: BaseException) -> bool:
    """A launched server that cannot come back (``DeploymentLostError``): the run stops with the reason."""
    return isinstance(error, DeploymentLostError)


def is_retryable(error: BaseException) -> bool:
    """A failure of the deployment rather than of the rollout: no connection, or a 5xx (a proxy episode's call too:
    its ``UpstreamFailedError`` says ``deployment_failure``)."""
    if is_fatal(error):
        return False
    if getattr(error, "deployment_failure", False) is True:
        return True
    if isinstance(error, DeploymentRequestError):
        return error.status is None or error.status >= 500
    return isinstance(error, (aiohttp.ClientConnectionError, ConnectionError))


class RunContext:
    """The parts of one RL run on rank 0, and the operations the loops compose."""

    def __init__(
        self,
        cfg: Config,
        rows: list[dict],
        eval_rows: list[dict],
        log_path: Path,
        state: TrainState,
        deployment: DeploymentGroup,
        setup: RolloutSetup,
        rollout_fn: RolloutFn,
        teacher: Optional[Teacher] = None,
    ):
        self.cfg = cfg
        self.rows = rows
        self.eval_rows = eval_rows
        self.log_path = log_path
        self.trainer = state.trainer
        self.reference = state.reference
        self.cursor = state.cursor
        self.start_step = state.start_step
        self.vocab_size = state.vocab_size
        self.deployment = deployment
        self.setup = setup
        self.rollout_fn = rollout_fn
        self.teacher = teacher
        """The distillation teacher (``cfg.distillation``), or None."""
        self.total_steps = cfg.max_steps or max(1, self.cursor.total // cfg.prompt_groups_per_step)
        """Planned steps; a run whose rows run out first (filtering) stops early."""
        self.counters = StepCounters()
        self.semaphore = asyncio.Semaphore(cfg.max_concurrency)
        """Bounds the rollouts in flight (training and eval)."""
        self.metrics = MetricsLogger(
            log_path,
            self.total_steps,
            cfg.wandb,
            cfg.to_dict(),
            resume_step=self.start_step,
            tensorboard_cfg=cfg.tensorboard,
            sample_every=cfg.sample_print_interval,
        )
        self._train_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        """The trainer's own thread: training never waits behind user code in asyncio's default pool."""
        self._mismatch_state = "watch"
        """The mismatch probes: ``watch`` each step's gap, ``due`` at the next step, ``done`` (once per run)."""
        release_openmp_threads()  # the models were built on this thread; from here the trainer's thread computes
        self.groups_in_flight = 0
        """Training groups being sampled (``run_group`` calls not yet returned)."""
        self._checkpoint_s = 0.0
        """Seconds the last checkpoint took, reported with the next step."""
        self._server_stats: Optional[asyncio.Future] = None
        """The servers' ``GET /stats``, read while the trainer trains; ``finish_step`` reports it."""
        self.failure_log = FailureLog("rollout")
        """Training rollouts' failures: the first of each kind printed with its traceback, the rest counted."""
        self.eval_failure_log = FailureLog("eval rollout")
        self.requeues: dict[int, int] = {}
        """Row position -> times in a row its group was requeued for a deployment failure (``requeue``)."""
        self._sampler_seen: dict[str, int] = {}
        """The sampler's ``restart_retries`` / ``restart_waits`` and the rollout function's ``drain_cancelled_calls``
        totals at the previous step."""

    # ---- rollouts ---------------------------------------------------------------------
    async def run_group(self, position: int, submit_version: int) -> PromptGroup:
        row_index = self.cursor.row_index(position)
        row = self.rows[row_index]
        self.groups_in_flight += 1
        try:
            group = await run_group(
                self.rollout_fn,
                row,
                position,
                submit_version,
                self.cfg.completions_per_prompt,
                self.cfg.rollout_timeout_s,
                self.semaphore,
                self.vocab_size,
                is_retryable,
                row_index=row_index,
                failure_log=self.failure_log,
                seed=self.cfg.seed,
                is_fatal=is_fatal,
            )
            apply_reward_components(group, self.cfg.reward_weights, self.failure_log)  # checked; combined when weighted
            if self.cfg.group_reward_fn is not None:  # a judge scores the finished group's members together
                await apply_group_reward(self.cfg.group_reward_fn, group, self.failure_log)
            apply_overlong(group, self.cfg.overlong)  # DAPO's length shaping and truncation filter, when set
            return group
        except DeploymentLostError as e:  # one "run stopped:" line naming the server and its log (run.py)
            raise DeploymentStartError(str(e), summary=e.reason) from e
        finally:
            self.groups_in_flight -= 1

    def share_cpu(self, share: CpuShare) -> None:
        """Give the trainer (and a separate reference model) ``share``'s threads: fewer while groups are in flight."""

        def budget() -> int:
            return share.trainer_threads_busy if self.groups_in_flight else share.trainer_threads_idle

        for model in (self.trainer, self.reference):
            if model is not None:
                model.share_cpu(budget)

    def accept_group(self, group: PromptGroup) -> bool:
        """Count the group's outcomes; True if it is kept for training (advantages set). With a teacher the
        ``dynamic_filter_fn`` waits for ``distill`` (the group's distillation signal is not known yet)."""
        c = self.counters
        if group.deployment_failures:
            return self.requeue(group)
        self.requeues.pop(group.position, None)
        c.add(group)
        if (
            c.attempts >= self.cfg.error_check_min_attempts
            and c.failures / c.attempts > self.cfg.max_rollout_error_fraction
        ):
            raise RolloutFailureError(
                f"{c.failures} of {c.attempts} rollouts failed since the last step ({c.errors} raised, "
                f"{c.timeouts} timed out, {c.invalid} invalid), more than max_rollout_error_fraction="
                f"{self.cfg.max_rollout_error_fraction}; see the warnings above for the rows and errors"
            )
        if c.attempts >= self.cfg.error_check_min_attempts and c.dropped == c.attempts:  # nothing could ever train
            raise RolloutFailureError(
                f"rollout_fn returned None for all {c.attempts} rollouts since the last step (None drops a "
                "completion): return a RolloutSample or RolloutRun (a forgotten `return`?)"
            )
        if c.attempts >= self.cfg.error_check_min_attempts and c.overlong_filtered == c.attempts:
            raise RolloutFailureError(
                f"all {c.attempts} completions since the last step were cut off for length and "
                "overlong.filter_truncated keeps them out of training: raise the sampling max_tokens, or set "
                "overlong.filter_truncated=false"
            )
        keep = True
        if len(group.completion_rewards) < 2:
            c.small_groups += 1
            keep = False
        elif self.teacher is None and self.cfg.dynamic_filter_fn is not None and not self.cfg.dynamic_filter_fn(group):
            c.filtered_groups += 1
            keep = False
        if keep:
            group.compute_advantages(self.cfg.advantage_std_scaling)
        else:
            self.cursor.mark_done(group.position)
        return keep

    def requeue(self, group: PromptGroup) -> bool:
        """A group some completion of which failed for a deployment reason (after its retry): its row is requeued,
        rolled out again later, never marked done untrained, and nothing of it trains (a crash never leaves a
        group of only the completions that finished before it). Counted in ``rollout/requeued_groups``, not in
        ``max_rollout_error_fraction``; the ``MAX_GROUP_REQUEUES``-th requeue of one row in a row stops the run.
        Returns False (not kept)."""
        n = self.requeues[group.position] = self.requeues.get(group.position, 0) + 1
        label = row_label(group.row, group.row_index, group.position)
        if n >= MAX_GROUP_REQUEUES:
            raise RolloutFailureError(
                f"the group of {label} failed for a deployment reason {n} times in a row "
                f"({group.failure_causes}); is the deployment serving? see deployment.log"
            )
        logger.warning(
            "%d of %d completions of %s failed for a deployment reason (%s): the row is rolled out again later",
            group.deployment_failures,
            group.attempts,
            label,
            group.failure_causes,
        )
        self.counters.requeued_groups += 1
        self.cursor.requeue(group.position)
        return False

    def take_counters(self) -> dict[str, float]:
        m = self.counters.metrics()
        sampler = self.deployment.sampler
        totals = (  # running totals, as per-step counts: the sampler's restarts, a proxy rollout's drain cancellations
            (sampler, "restart_retries"),
            (sampler, "restart_waits"),
            (self.rollout_fn, "drain_cancelled_calls"),
        )
        for source, name in totals:
            total = getattr(source, name, 0) if source is not None else 0
            m[f"rollout/{name}"] = float(total - self._sampler_seen.get(name, 0))
            self._sampler_seen[name] = total
        m["rollout/failures_unprinted"] = float(self.failure_log.take_unprinted())
        m.update(group_reward_metrics(self.cfg.group_reward_fn))
        self.counters = StepCounters()
        return m

    # ---- train and sync ---------------------------------------------------------------
    async def distill(self, groups: list[PromptGroup]) -> tuple[list[PromptGroup], dict[str, float]]:
        """On-policy distillation, before ``train``: the teacher scores every sample and its advantage becomes the
        per-token one (``teacher.py``); then ``dynamic_filter_fn`` runs on the scored groups, so it judges the
        advantages the group would train with (a group of equal rewards still carries the teacher's per-token
        signal; ``has_learning_signal`` keeps it). A dropped group's row is marked done, as in ``accept_group``.
        Returns the kept groups (possibly none: the loop then trains no step on them) and the ``distill/*`` metrics
        with ``rollout/filtered_groups``. ``(groups, {})`` without a teacher."""
        if self.teacher is None:
            return groups, {}
        m = await self.teacher.distill(groups)
        keep = self.cfg.dynamic_filter_fn
        kept = groups if keep is None else [g for g in groups if keep(g)]
        if len(kept) < len(groups):
            kept_ids = {id(g) for g in kept}
            for g in groups:
                if id(g) not in kept_ids:
                    self.cursor.mark_done(g.position)
        m["rollout/filtered_groups"] = float(len(groups) - len(kept))
        return kept, m

    async def train(self, groups: list[PromptGroup], step: int) -> dict[str, float]:
        """One PPO step on ``groups`` in the trainer's thread; returns ``train/*`` metrics. The servers' ``GET /stats``
        is read meanwhile (``finish_step`` reports it without waiting for it). Once a step's engine-trainer gap passes
        ``mismatch_probe_threshold``, the next step first runs the mismatch probes (``probe_mismatch``)."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        self._server_stats = asyncio.ensure_future(self.deployment.server_stats())
        probed = await self.probe_mismatch(groups, step) if self._mismatch_state == "due" else {}
        metrics = await loop.run_in_executor(
            self._train_pool,
            lambda: train_on_groups(
                self.trainer,
                groups,
                cfg.loss,
                reference=self.reference,
                ppo_epochs=cfg.ppo_epochs,
                ppo_mini_batches=cfg.ppo_mini_batches,
                temperature=cfg.temperature,
                seed=cfg.seed + step,
                refresh_reference=refreshes_reference(cfg.loss, step + 1),
            ),
        )
        threshold = cfg.mismatch_probe_threshold
        if self._mismatch_state == "watch" and threshold and metrics.get("train/logprob_diff_mean", 0.0) > threshold:
            self._mismatch_state = "due"
        return {**metrics, **probed}

    async def probe_mismatch(self, groups: list[PromptGroup], step: int) -> dict[str, float]:
        """The mismatch probes on up to ``PROBE_SAMPLES`` samples of ``groups`` generated by the weights the trainer
        holds (version ``step``), once per run: one warning and the ``mismatch/*`` metrics
        (training/utils/rl/mismatch_probe.py). A step without such samples (off-policy) waits for the next one."""
        if is_distributed():  # the probes score on rank 0 alone; the other ranks' FSDP shards are not there
            self._mismatch_state = "done"
            logger.warning("logprob mismatch past mismatch_probe_threshold; the probes do not run under torchrun")
            return {}
        samples = [
            s
            for g in groups
            if g.submit_version == step
            for s in g.samples
            if all(v == step for v in (s.token_weight_versions or ()))
        ][:PROBE_SAMPLES]
        if not samples:
            return {}
        self._mismatch_state = "done"
        tokens = [s.tokens for s in samples]
        engine_scores, engine_skipped = None, None
        if self.cfg.temperature != 1.0:
            engine_skipped = f"temperature {self.cfg.temperature:g}: vLLM's prompt logprobs are unscaled"
        else:
            try:
                scored = await self.deployment.sampler.prompt_logprobs(tokens, max_tokens=1)
                engine_scores = [a.logprobs for a in scored]
            except Exception as e:  # a deployment that cannot score: the trainer-side probes still say something
                engine_skipped = f"the deployment did not score them: {e}"
        report = await asyncio.get_running_loop().run_in_executor(
            self._train_pool,
            lambda: probe_mismatch(
                self.trainer,
                step,
                tokens,
                [s.logprobs for s in samples],
                [s.loss_mask for s in samples],
                self.cfg.temperature,
                engine_scores,
                engine_skipped,
            ),
        )
        logger.warning("%s", report.line())
        return report.metrics()

    @contextlib.asynccontextmanager
    async def colocated(self, timer: StepTimer) -> AsyncIterator[dict[str, float]]:
        """Around a step's train and push when ``deployment.colocate``: the replicas sleep at
        ``deployment.sleep_level`` before, and wake after (also when the step failed). The yielded dict
        gets the ``colocate/*`` metrics after the wake (the replicas' sleep and wake counts); without
        ``colocate`` nothing happens and it stays empty."""
        out: dict[str, float] = {}
        deploy = self.cfg.deployment
        if not deploy.colocate:
            yield out
            return
        with timer.phase("sleep"):
            slept = await self.deployment.sleep(deploy.sleep_level)
        try:
            yield out
        finally:
            with timer.phase("wake"):
                if torch.cuda.is_available():  # the trainer's freed blocks (grads, activations) go to the engine
                    torch.cuda.empty_cache()
                woke = await self.deployment.wake_up()
            out["colocate/freed_bytes"] = float(sum(sum(s.get("freed", {}).values()) for s in slept))
            out["colocate/server_sleeps"] = float(sum(w.get("sleeps", 0) for w in woke))
            out["colocate/server_wakes"] = float(sum(w.get("wakes", 0) for w in woke))

    def sync_due(self, step_done: int) -> bool:
        """Weights are pushed after every ``weight_sync_interval``-th step, and before each eval (so that an eval
        scores the weights of the step it reports)."""
        return step_done % self.cfg.weight_sync_interval == 0 or self.eval_due(step_done)

    async def sync_weights(self, version: int, force: bool = False) -> float:
        """Push the trainer's weights to every replica as ``version``; seconds taken. ``force``: the run's
        first push, which may go below the version an earlier run left on an attached server."""
        t0 = time.perf_counter()
        await self.deployment.push(
            self.trainer.named_weights(),
            version,
            specs=self.trainer.weight_specs(),
            wait_for_inflight=not self.cfg.inflight_weight_updates,
            force=force,
        )
        return time.perf_counter() - t0

    # ---- eval, checkpoints ----------------------------------------------------------
    def eval_due(self, step: int) -> bool:
        """Eval before the first step, every eval_interval steps, and after the last."""
        return (
            bool(self.eval_rows)
            and self.cfg.eval_interval > 0
            and (step == 0 or step % self.cfg.eval_interval == 0 or step == self.total_steps)
        )

    async def evaluate(self) -> dict[str, float]:
        """Roll out every eval row once with the deployed weights: eval/reward_mean, eval/pass_rate, eval/failed.

        A failed eval rollout (it raised, timed out, or returned no RolloutSample / RolloutRun / None or a
        reward the contract refuses: ``result_reward``) scores 0 and is reported like a training failure,
        naming the row; ``eval/failed`` counts them. Row ``i``'s requests are seeded from ``(cfg.seed, i, 0)``, so
        every eval of a run draws the same seeds, and ``python -m training.eval --seed <cfg.seed>`` the same again. The scoring is ``score_rows`` (``training/utils/rl/eval_rollouts.py``),
        which ``python -m training.eval`` shares."""
        scores = await score_rows(
            self.rollout_fn,
            self.eval_rows,
            semaphore=self.semaphore,
            timeout_s=self.cfg.rollout_timeout_s,
            failure_log=self.eval_failure_log,
            seed=self.cfg.seed,  # row i's request seeds derive from (seed, i, 0): python -m training.eval --seed draws the same
        )
        rewards = scores.flat_rewards
        return {
            "eval/failed": float(len(scores.failed)),
            "eval/reward_mean": sum(rewards) / len(rewards),
            "eval/pass_rate": sum(1.0 for r in rewards if r > 0) / len(rewards),
        }

    async def start_run(self) -> None:
        """Before the first step: sync a resumed run's (or an attached server's) weights; eval at step 0."""
        if self.start_step > 0 or not self.deployment.launched:
            await self.sync_weights(self.start_step, force=True)
        if self.eval_due(self.start_step):
            self.metrics.log(self.start_step, await self.evaluate())

    async def finish_step(self, groups: list[PromptGroup], step_done: int, timer: StepTimer) -> dict[str, float]:
        """After a trained step: mark its rows done and evaluate when due (the loop pushed the step's weights
        first: ``push_due``). Returns the ``eval/*`` metrics (empty when no eval was due) and the servers'
        ``perf/server_rss_mb`` and ``perf/kv_blocks_*`` (``server_metrics``, read during training). The previous step's checkpoint time goes into ``timer``
        (``perf/checkpoint_s``): the checkpoint is written after the log."""
        for g in groups:
            self.cursor.mark_done(g.position)
        if self._checkpoint_s:
            timer.seconds["checkpoint"] = self._checkpoint_s
            self._checkpoint_s = 0.0
        out = await self.evaluate() if self.eval_due(step_done) else {}
        out.update(self._take_server_metrics())
        return out

    def _take_server_metrics(self) -> dict[str, float]:
        """``server_metrics`` of the stats read during this step's training; empty if they did not arrive in time."""
        task, self._server_stats = self._server_stats, None
        if task is None or not task.done():
            if task is not None:
                task.cancel()
            return {}
        if task.cancelled() or task.exception() is not None:
            return {}
        return server_metrics(task.result())

    def log_step(self, step: int, m: dict[str, float], groups: list[PromptGroup]) -> None:
        """Write step ``step``'s metrics and rollouts. A loop logs a step before ``checkpoint_step``: a run killed in
        between resumes from the checkpoint before and trains the step again (its rows set aside as replaced), so a
        step's records are never lost."""
        self.metrics.log(step, m)
        self.metrics.log_rollouts(step, groups)

    async def checkpoint_step(self, step_done: int) -> None:
        """Write the checkpoint after ``step_done`` steps when due (after the step's log; its time is reported in the
        next step's ``perf/checkpoint_s``). The run's state (cursor, RNG) is taken here, on the event loop, between
        two steps; the DCP write runs in the trainer's thread (``_train_pool``, where every trainer collective of
        rank 0 runs, under ``lead``: the other ranks of a torchrun follow it as before), so the loop keeps serving the
        rollouts in flight while it writes. The caller awaits it before the next step trains."""
        if self.checkpoint_due(step_done):
            t0 = time.perf_counter()
            state = self.checkpoint_state(step_done)
            await asyncio.get_running_loop().run_in_executor(self._train_pool, self.write_checkpoint, step_done, state)
            self._checkpoint_s = time.perf_counter() - t0

    def finish_run(self, steps_done: int) -> None:
        """After the loop: the final checkpoint (when checkpoints are on and it was not written yet)."""
        if self.cfg.dcp_save_interval > 0 and steps_done > self.start_step and not self.checkpoint_due(steps_done):
            self.save_checkpoint(steps_done)

    def checkpoint_due(self, step_done: int) -> bool:
        i = self.cfg.dcp_save_interval
        return i > 0 and (step_done % i == 0 or step_done == self.total_steps)

    def checkpoint_state(self, step_done: int) -> dict:
        """The run's state saved beside the weights: step, weight version, data cursor, RNG (taken on the loop)."""
        return {"step": step_done, "weight_version": step_done, "cursor": self.cursor.state(), "rng": rng_state()}

    def save_checkpoint(self, step_done: int) -> None:
        """Write a DCP checkpoint from this thread (under torchrun: rank 0 calls this, the other ranks follow)."""
        self.write_checkpoint(step_done, self.checkpoint_state(step_done))
        release_openmp_threads()  # the trainer's thread computes; this one keeps no OpenMP pool

    def write_checkpoint(self, step_done: int, state: dict) -> None:
        """The DCP write of ``state`` with the trainer's model and optimizer (``lead``: the other ranks follow)."""
        with lead(Command.CHECKPOINT, step_done):
            save_checkpoint(
                self.log_path / "checkpoints",
                step_done,
                self.trainer.model,
                self.trainer.optimizer,
                state,
                keep_last=self.cfg.keep_checkpoints,
                critic=getattr(self.trainer, "critic", None),
                reference=self.reference if self.cfg.loss.reference_refresh_interval else None,
            )

    async def wait_for(self, changed: asyncio.Event, in_flight: int, last_progress: float) -> float:
        """Wait for ``changed`` (a rollout finished); raise when nothing finished for ``stall_timeout_s``.

        Returns the time of the latest progress."""
        changed.clear()
        try:
            await asyncio.wait_for(changed.wait(), timeout=WAIT_POLL_S)
            return time.perf_counter()
        except asyncio.TimeoutError:
            if time.perf_counter() - last_progress > self.cfg.stall_timeout_s:
                raise RuntimeError(
                    f"no rollout finished for {self.cfg.stall_timeout_s:.0f} s (in flight: "
                    f"{in_flight}); is the deployment alive? see deployment.log"
                ) from None
            return last_progress

    def close(self) -> None:
        """Close the metrics (wandb included) and the trainer's thread."""
        self.metrics.close()
        self._train_pool.shutdown(wait=False)
