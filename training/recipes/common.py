"""What both recipes share: ``run_recipe`` (set-up, run, finish), the ``RunContext`` of one run, and
the per-step helpers.

``run_recipe(loop_cls, cfg, rollout_fn_factory, rows)`` is every recipe's ``main``:

1. set-up: process group (under ``torchrun``), rows and the resumable data cursor, the trainer and
   the reference model (``TrainState``: resumed from the newest checkpoint in ``log_path``);
2. on ranks other than 0: follow rank 0's commands until it stops (``follow_rank0``);
3. on rank 0: start or attach the deployment (``DeploymentGroup``), call ``make_rollout_fn(setup)``
   once, build the ``RunContext``, and run ``loop_cls(ctx).run()``;
4. finish: export the final policy, stop the deployment (also on errors and Ctrl-C).

``RunContext`` owns the long-lived parts (trainer, reference model, deployment, rollout function,
data cursor, metrics) and the operations on them; a loop owns only the order in which they happen:
collect → ``train`` → ``sync_weights`` → ``finish_step`` → log.

Under ``torchrun`` every rank builds the same ``TrainState`` (the model sharded with FSDP2); rank 0
runs the loop and is the only one to start the deployment, roll out, log and write metrics; the
others take part in each training step, weight gather, checkpoint and export that rank 0 announces
(``training/utils/dist.py``).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import random
import signal
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import aiohttp
import torch

from training.deployment.group import DeploymentGroup
from training.deployment.client import DeploymentRequestError
from training.models import resolve_model
from training.recipes.config import RESUME_MAY_CHANGE, WAIT_POLL_S, Config
from training.recipes.resources import (
    CpuShare,
    cpu_share,
    log_start_notes,
    promote_final_model,
    resolve_rollout_factory,
    resolve_rows,
    rollout_tokenizer,
)
from training.utils import dist, loop_watch
from training.utils.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.utils.data import Rows, RowCursor, load_rows
from training.utils.dist import Command, lead
from training.utils.metrics import MetricsLogger
from training.utils.openmp import release_openmp_threads
from training.utils.run_record import check_log_path, write_config_record
from training.utils.rl.groups import PromptGroup, run_group
from training.utils.rl.losses import needs_reference_logprobs
from training.utils.rl.ppo import receive_and_train, train_on_groups
from training.utils.rl.rollout import RolloutFn, RolloutSetup
from training.utils.rl.run_metrics import run_metrics

logger = logging.getLogger("training.recipe")

RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]


class RolloutFailureError(RuntimeError):
    """Too many rollouts of a step failed: the run stops instead of training on what is left."""


@dataclass
class TrainState:
    """The parts every rank builds: the data cursor, the policy trainer, the reference model, where
    the run resumes."""

    cursor: RowCursor
    trainer: Any
    """``PolicyTrainer``."""
    reference: Any
    """``ReferenceModel`` (with LoRA: the policy's base weights, adapters off) when the loss needs reference
    logprobs, else None."""
    start_step: int
    """0 for a fresh run; the step after the newest checkpoint for a resumed one."""

    @property
    def tokenizer(self) -> Any:
        return self.trainer.tokenizer

    @property
    def vocab_size(self) -> int:
        return int(self.trainer.model.get_input_embeddings().weight.shape[0])


def build_train_state(cfg: Config, model_path: str, num_rows: int, log_path: Path) -> TrainState:
    """Load the policy (and the frozen reference when the loss needs it), resume if a checkpoint exists."""
    from training.trainer import PolicyTrainer, ReferenceModel

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    cursor = RowCursor(num_rows, cfg.epochs, cfg.seed, cfg.shuffle_rows)
    trainer = PolicyTrainer(model_path, cfg.trainer)
    reference = None
    if needs_reference_logprobs(cfg.loss):  # with LoRA: the policy's own base weights, adapters off
        reference = trainer.base_reference() if trainer.lora else ReferenceModel(model_path, cfg.trainer)
    start_step = 0
    ckpt = latest_checkpoint(log_path / "checkpoints")
    if ckpt is not None:
        state = load_checkpoint(ckpt, trainer.model, trainer.optimizer)
        start_step = int(state["step"])
        cursor.load_state(state["cursor"])
        set_rng_state(state["rng"])
        logger.info("resumed from %s at step %d", ckpt, start_step)
    return TrainState(cursor, trainer, reference, start_step)


class StepCounters:
    """Rollout outcomes since the last step (what ``rollout/*`` reports), plus the agent runs'
    ``agent/*`` and ``rollout/failed/<cause>`` metrics (``training/utils/rl/run_metrics.py``)."""

    def __init__(self):
        self.attempts = self.failures = self.errors = self.timeouts = self.invalid = self.dropped = 0
        self.groups_done = self.filtered_groups = self.small_groups = 0
        self.generated_tokens = 0
        self.run_metadata: list[dict] = []
        self.failure_causes: dict[str, int] = {}

    def add(self, g: PromptGroup) -> None:
        self.attempts += g.attempts
        self.failures += g.failures
        self.errors += g.errors
        self.timeouts += g.timeouts
        self.invalid += g.invalid
        self.dropped += g.dropped
        self.groups_done += 1
        self.generated_tokens += sum(s.num_trainable_tokens for s in g.samples)
        self.run_metadata.extend(g.metadata.values())
        for cause, n in g.failure_causes.items():
            self.failure_causes[cause] = self.failure_causes.get(cause, 0) + n

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/attempts": float(self.attempts),
            "rollout/errors": float(self.errors),
            "rollout/timeouts": float(self.timeouts),
            "rollout/invalid": float(self.invalid),
            "rollout/returned_none": float(self.dropped),
            "rollout/filtered_groups": float(self.filtered_groups),
            "rollout/too_small_groups": float(self.small_groups),
            "rollout/generated_tokens": float(self.generated_tokens),
            **run_metrics(self.run_metadata, self.failure_causes),
        }


class StepTimer:
    """Seconds of one step, in total and per phase: ``perf/step_time_s`` and ``perf/<phase>_s``."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t

    def metrics(self, m: dict[str, float]) -> dict[str, float]:
        """The ``perf/*`` metrics of the step, with token rates from ``m`` (the step's other metrics)."""
        total = time.perf_counter() - self.t0
        out = {"perf/step_time_s": total, **{f"perf/{k}_s": v for k, v in self.seconds.items()}}
        out["perf/generated_tokens_per_s"] = m.get("rollout/generated_tokens", 0.0) / max(total, 1e-9)
        out["perf/trained_tokens_per_s"] = m.get("train/tokens", 0.0) / max(self.seconds.get("train", 0.0), 1e-9)
        return out


def batch_metrics(groups: list[PromptGroup]) -> dict[str, float]:
    """``rollout/*`` metrics of the groups a step trains on."""
    rewards = [r for g in groups for r in g.rewards]
    lengths = [s.num_trainable_tokens for g in groups for s in g.samples]
    n = max(len(rewards), 1)
    mean = sum(rewards) / n
    return {
        "rollout/reward_mean": mean,
        "rollout/reward_std": (sum((r - mean) ** 2 for r in rewards) / n) ** 0.5,
        "rollout/groups": float(len(groups)),
        "rollout/samples": float(sum(len(g.samples) for g in groups)),
        "rollout/completion_tokens_mean": sum(lengths) / max(len(lengths), 1),
        "rollout/truncated_fraction": sum(1.0 for g in groups for s in g.samples if s.finish_reason == "length")
        / max(len(lengths), 1),
    }


def is_retryable(error: BaseException) -> bool:
    """A failure of the deployment rather than of the rollout: no connection, or a 5xx."""
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
        self.total_steps = cfg.max_steps or max(1, self.cursor.total // cfg.prompt_groups_per_step)
        """Planned steps; a run whose rows run out first (filtering) stops early."""
        self.counters = StepCounters()
        self.semaphore = asyncio.Semaphore(cfg.max_concurrency)
        """Bounds the rollouts in flight (training and eval)."""
        self.metrics = MetricsLogger(log_path, self.total_steps, cfg.wandb, cfg.to_dict(), resume_step=self.start_step)
        self._train_pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer")
        """The trainer's own thread: training never waits behind user code in asyncio's default pool."""
        release_openmp_threads()  # the models were built on this thread; from here the trainer's thread computes
        self.groups_in_flight = 0
        """Training groups being sampled (``run_group`` calls not yet returned)."""

    # ---- rollouts ---------------------------------------------------------------------
    async def run_group(self, position: int, submit_version: int) -> PromptGroup:
        row = self.rows[self.cursor.row_index(position)]
        self.groups_in_flight += 1
        try:
            return await run_group(
                self.rollout_fn,
                row,
                position,
                submit_version,
                self.cfg.completions_per_prompt,
                self.cfg.rollout_timeout_s,
                self.semaphore,
                self.vocab_size,
                is_retryable,
            )
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
        """Count the group's outcomes; True if it is kept for training (advantages set)."""
        c = self.counters
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
        keep = True
        if len(group.completion_rewards) < 2:
            c.small_groups += 1
            keep = False
        elif self.cfg.dynamic_filter_fn is not None and not self.cfg.dynamic_filter_fn(group):
            c.filtered_groups += 1
            keep = False
        if keep:
            group.compute_advantages(self.cfg.advantage_std_scaling)
        else:
            self.cursor.mark_done(group.position)
        return keep

    def take_counters(self) -> dict[str, float]:
        m = self.counters.metrics()
        self.counters = StepCounters()
        return m

    # ---- train and sync ---------------------------------------------------------------
    async def train(self, groups: list[PromptGroup], step: int) -> dict[str, float]:
        """One PPO step on ``groups`` in the trainer's thread; returns ``train/*`` metrics."""
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
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
            ),
        )

    def sync_due(self, step_done: int) -> bool:
        """Weights are pushed after every ``weight_sync_interval``-th step."""
        return step_done % self.cfg.weight_sync_interval == 0

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
        """Roll out every eval row once with the deployed weights: eval/reward_mean and eval/pass_rate."""

        async def one(row):
            async with self.semaphore:
                try:
                    result = await loop_watch.wait_for(self.rollout_fn(row), self.cfg.rollout_timeout_s)
                except Exception as e:  # noqa: BLE001 - an eval failure scores 0, never stops the run
                    logger.warning("eval rollout raised %s: %s", type(e).__name__, e)
                    return 0.0
                return float(getattr(result, "reward", 0.0)) if result is not None else 0.0

        rewards = await asyncio.gather(*(one(r) for r in self.eval_rows))
        return {
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
        """After a trained step: mark its rows done, evaluate and checkpoint when due.

        Returns the ``eval/*`` metrics (empty when no eval was due); the checkpoint is timed in ``timer``."""
        for g in groups:
            self.cursor.mark_done(g.position)
        evals = await self.evaluate() if self.eval_due(step_done) else {}
        with timer.phase("checkpoint"):
            if self.checkpoint_due(step_done):
                self.save_checkpoint(step_done)
        return evals

    def log_step(self, step: int, m: dict[str, float], groups: list[PromptGroup]) -> None:
        self.metrics.log(step, m)
        self.metrics.log_rollouts(step, groups)

    def finish_run(self, steps_done: int) -> None:
        """After the loop: the final checkpoint (when checkpoints are on and it was not written yet)."""
        if self.cfg.dcp_save_interval > 0 and steps_done > self.start_step and not self.checkpoint_due(steps_done):
            self.save_checkpoint(steps_done)

    def checkpoint_due(self, step_done: int) -> bool:
        i = self.cfg.dcp_save_interval
        return i > 0 and (step_done % i == 0 or step_done == self.total_steps)

    def save_checkpoint(self, step_done: int) -> None:
        """Write a DCP checkpoint (under torchrun: rank 0 calls this, the other ranks follow)."""
        state = {"step": step_done, "weight_version": step_done, "cursor": self.cursor.state(), "rng": rng_state()}
        with lead(Command.CHECKPOINT, step_done):
            save_checkpoint(
                self.log_path / "checkpoints",
                step_done,
                self.trainer.model,
                self.trainer.optimizer,
                state,
                keep_last=self.cfg.keep_checkpoints,
            )
        release_openmp_threads()  # the trainer's thread computes; this one keeps no OpenMP pool

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


def follow_rank0(cfg: Config, state: TrainState, log_path: Path) -> int:
    """Ranks other than 0 under torchrun: take part in what rank 0 announces until it stops.

    Returns the argument of rank 0's STOP (the steps it completed). Never starts the deployment,
    rolls out, or writes metrics.
    """
    trainer = state.trainer
    return dist.follow(
        {
            Command.TRAIN: lambda _: receive_and_train(trainer, cfg.loss, reference=state.reference),
            Command.WEIGHTS: lambda _: collections.deque(trainer.named_weights(), maxlen=0),
            Command.CHECKPOINT: lambda step: save_checkpoint(
                log_path / "checkpoints", step, trainer.model, trainer.optimizer, None, keep_last=cfg.keep_checkpoints
            ),
            Command.EXPORT: lambda _: trainer.save_pretrained(log_path / "final"),
        }
    )


def start_rollouts(
    cfg: Config,
    model_path: str,
    log_path: Path,
    state: TrainState,
    rollout_fn_factory: RolloutFnFactory,
    rollout_extras: dict[str, Any],
    share: Optional[CpuShare] = None,
) -> tuple[DeploymentGroup, RolloutSetup, RolloutFn]:
    """Start (or attach) the deployment, build the ``RolloutSetup`` and call ``make_rollout_fn`` once
    (``share``: the embedded servers' threads when they share the trainer's CPU)."""
    dcfg = cfg.deployment
    if dcfg.engine_config.seed is None:  # the run's seed: runs with different seeds sample differently
        dcfg = replace(dcfg, engine_config=replace(dcfg.engine_config, seed=cfg.seed))
    if share is not None:
        dcfg = replace(dcfg, engine_config=replace(dcfg.engine_config, num_threads=share.engine_threads))
    tokenizer = rollout_tokenizer(cfg, model_path, state.tokenizer, state.vocab_size)
    deployment = DeploymentGroup(model_path, dcfg, log_dir=log_path).start(tokenizer)
    try:
        sampling = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, **cfg.sampling_kwargs}
        setup = RolloutSetup(
            sampler=deployment.sampler,
            tokenizer=tokenizer,
            sampling_kwargs=sampling,
            extras=rollout_extras,
            max_seq_len=dcfg.engine_config.max_model_len,
        )
        deployment.hooks = setup.weight_sync_hooks  # the same list: hooks added by make_rollout_fn count
        rollout_fn = rollout_fn_factory(setup)
        if not callable(rollout_fn):
            raise TypeError("rollout_fn_factory(setup) must return an async function rollout_fn(row)")
    except BaseException:
        deployment.stop()
        raise
    return deployment, setup, rollout_fn


def run_recipe(
    loop_cls,
    cfg: Config,
    rollout_fn_factory: Optional[RolloutFnFactory] = None,
    rows: Optional[Rows] = None,
    rollout_extras: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Set up, run ``loop_cls(ctx).run()`` to the end, export, always stop the deployment.

    ``rows`` default to ``cfg.dataset``, ``rollout_fn_factory`` to the built-in single-turn rollout
    (``resources.py``). Returns ``{"steps", "last_metrics", "final_model", "output_model"}``
    (``output_model``: the promoted folder, when ``cfg.output_model_id`` is set). Under ``torchrun`` the
    ranks other than 0 follow rank 0 and return ``{"steps": <rank 0's steps>, "last_metrics": {},
    "final_model": None}``.
    """
    with _sigterm_as_exit():
        return _run_recipe(loop_cls, cfg, rollout_fn_factory, rows, rollout_extras)


@contextlib.contextmanager
def _sigterm_as_exit():
    """SIGTERM raises ``SystemExit(143)`` in the main thread, so a terminated run unwinds like Ctrl-C:
    the deployment stops and the /dev/shm weights are removed (the default action skips all cleanup)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_sigterm(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_recipe(
    loop_cls,
    cfg: Config,
    rollout_fn_factory: Optional[RolloutFnFactory],
    rows: Optional[Rows],
    rollout_extras: Optional[dict[str, Any]],
) -> dict[str, Any]:
    started = dist.init_distributed(cfg.trainer.device)
    main_rank = dist.is_main_rank()
    logging.basicConfig(
        level=logging.INFO if main_rank else logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    steps = 0
    try:
        rows = resolve_rows(cfg, rows)
        rollout_fn_factory = resolve_rollout_factory(cfg, rollout_fn_factory)
        eval_rows = load_rows(cfg.eval_rows) if cfg.eval_rows is not None else []
        model_path = resolve_model(cfg.base_model)
        log_path = Path(cfg.log_path)
        log_path.mkdir(parents=True, exist_ok=True)
        check_log_path(
            log_path,
            cfg.to_dict(),
            has_checkpoint=latest_checkpoint(log_path / "checkpoints") is not None,
            ignore=RESUME_MAY_CHANGE,
            resume_anyway=cfg.resume_with_changed_config,
        )
        if main_rank:
            write_config_record(log_path, cfg.to_dict())
        state = build_train_state(cfg, model_path, len(rows), log_path)
        try:
            if not main_rank:
                return {"steps": follow_rank0(cfg, state, log_path), "last_metrics": {}, "final_model": None}
            log_start_notes(cfg, model_path)
            share = cpu_share(cfg, loop_cls.overlaps(cfg))
            if share is not None:
                logger.info(
                    "trainer and server share this CPU: server %d thread(s) per replica, trainer %d while rollouts "
                    "run and %d otherwise (trainer.num_threads / deployment.engine_config.num_threads override)",
                    share.engine_threads,
                    share.trainer_threads_busy,
                    share.trainer_threads_idle,
                )
            deployment, setup, rollout_fn = start_rollouts(
                cfg, model_path, log_path, state, rollout_fn_factory, rollout_extras or {}, share
            )
            try:
                result = asyncio.run(
                    _run_loop(loop_cls, cfg, rows, eval_rows, log_path, state, deployment, setup, rollout_fn, share)
                )
                steps = result["steps"]
                final = None
                if cfg.export_final_model:
                    final = state.trainer.save_pretrained(log_path / "final")
                result["final_model"] = str(final) if final else None
                result["output_model"] = (
                    str(promote_final_model(final, cfg, log_path)) if final and cfg.output_model_id else None
                )
                return result
            finally:
                deployment.stop()
        finally:
            dist.stop_followers(steps)
    finally:
        if started:
            dist.shutdown_distributed()


async def _run_loop(
    loop_cls,
    cfg: Config,
    rows: list[dict],
    eval_rows: list[dict],
    log_path: Path,
    state: TrainState,
    deployment: DeploymentGroup,
    setup: RolloutSetup,
    rollout_fn: RolloutFn,
    share: Optional[CpuShare],
) -> dict[str, Any]:
    ctx = RunContext(cfg, rows, eval_rows, log_path, state, deployment, setup, rollout_fn)
    if share is not None:
        ctx.share_cpu(share)
    watchdog = loop_watch.LoopWatchdog().start()  # names loop-blocking rollout code; stalls do not time out rollouts
    try:
        return await loop_cls(ctx).run()
    finally:
        watchdog.stop()
        ctx.close()
        await deployment.close_sampler()
