"""The run's lifecycle: ``run_recipe`` (set-up, run, finish), which is every recipe's ``main``.

``run_recipe(loop_cls, cfg, rollout_fn_factory, rows)``:

1. set-up: process group (under ``torchrun``), the checks that take seconds (``base_model``, the
   trackers' packages: ``check_run_inputs``), rows and the resumable data cursor, the trainer and
   the reference model (``TrainState``: resumed from the newest checkpoint in ``log_path``);
2. on ranks other than 0: follow rank 0's commands until it stops (``follow_rank0``);
3. on rank 0: start or attach the deployment and call ``make_rollout_fn(setup)`` once
   (``start_rollouts``), start the distillation teacher when ``cfg.distillation`` is on
   (``teacher.py``), build the ``RunContext``, and run ``loop_cls(ctx).run()``;
4. finish: export the final policy, stop the deployment and the teacher (also on errors, Ctrl-C and SIGTERM).

Under ``torchrun`` every rank builds the same ``TrainState`` (the model sharded with FSDP2); rank 0
runs the loop and is the only one to start the deployment, roll out, log and write metrics; the
others take part in each training step, weight gather, checkpoint and export that rank 0 announces
(``training/utils/dist.py``).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import signal
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Optional

from training.deployment.group import DeploymentGroup
from training.launch.replicas import ray_deployment, under_ray
from training.deployment.backends.process import DeploymentStartError
from training.models import resolve_model
from training.recipes.config import RESUME_MAY_CHANGE, Config
from training.recipes.context import RolloutFailureError, RunContext
from training.recipes.memory_plan import plan_run
from training.recipes.resources import (
    CpuShare,
    check_run_inputs,
    cpu_share,
    log_start_notes,
    promote_final_model,
    resolve_engines,
    resolve_rollout_factory,
    resolve_rows,
    rollout_tokenizer,
)
from training.recipes.teacher import Teacher, start_teacher
from training.recipes.train_state import TrainState, build_train_state
from training.utils import dist
from training.utils.aio import loop_watch
from training.utils.checkpoint import latest_checkpoint, save_checkpoint
from training.utils.checkpoint_files import checkpoint_folders
from training.utils.config import ConfigError
from training.utils.user_errors import mark_user_error
from training.utils.data import Rows, load_rows
from training.utils.dist import Command
from training.utils.rl.ppo import receive_and_train
from training.utils.aio.loop_runner import run_loop
from training.utils.rl.rollout import RolloutFn, RolloutFnError, RolloutSetup, check_rollout_fn
from training.utils.run_record import resolve_log_path, write_config_record
from training.utils.run_summary import log_summary, run_summary

USER_ERRORS = (ConfigError, RolloutFailureError, RolloutFnError, FileNotFoundError, ModuleNotFoundError)
"""A newcomer's mistakes, each message naming the field and the fix (``training/utils/user_errors.py``)."""

logger = logging.getLogger("training.recipe")

RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]


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
                log_path / "checkpoints",
                step,
                trainer.model,
                trainer.optimizer,
                None,
                keep_last=cfg.keep_checkpoints,
                reference=state.reference if cfg.loss.reference_refresh_interval else None,
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
    replicas = None
    if under_ray():  # the Ray launcher's trainer rank 0: the replicas are actors in its placement group
        dcfg, replicas = ray_deployment(model_path, dcfg, str(log_path))
    deployment = DeploymentGroup(model_path, dcfg, log_dir=log_path, trainer=cfg.trainer, replicas=replicas)
    deployment.start(tokenizer)
    try:
        sampling = {"max_tokens": cfg.max_tokens, "temperature": cfg.temperature, **cfg.sampling_kwargs}
        setup = RolloutSetup(
            sampler=deployment.sampler,
            tokenizer=tokenizer,
            sampling_kwargs=sampling,
            extras=rollout_extras,
            max_seq_len=dcfg.engine_config.max_model_len,
            proxy_config=cfg.proxy,
        )
        deployment.hooks = setup.weight_sync_hooks  # the same list: hooks added by make_rollout_fn count
        rollout_fn = rollout_fn_factory(setup)
        check_rollout_fn(rollout_fn)
    except BaseException:
        deployment.stop()
        raise
    return deployment, setup, rollout_fn


def choose_log_path(cfg: Config, main_rank: bool) -> Path:
    """The folder this run writes to (``if_log_path_exists``; ``run_record.resolve_log_path``), created, with
    ``config.json`` written. Under torchrun rank 0 decides first; the others then find the folder it chose."""

    def resolve() -> Path:
        return resolve_log_path(
            cfg.log_path,
            cfg.to_dict(),
            cfg.if_log_path_exists,
            ignore=RESUME_MAY_CHANGE,
            resume_anyway=cfg.resume_with_changed_config,
        )

    log_path = None
    if main_rank:
        try:
            log_path = resolve()
            log_path.mkdir(parents=True, exist_ok=True)
            write_config_record(log_path, replace(cfg, log_path=str(log_path)).to_dict())
        except OSError as e:  # a read-only or impossible folder: one line naming the setting, not a raw OSError
            raise ConfigError(
                f"log_path: cannot write {e.filename or cfg.log_path} ({e.strerror}); set log_path=<a writable folder>"
            ) from e
    dist.barrier()
    return log_path if log_path is not None else resolve()


def run_recipe(
    loop_cls,
    cfg: Config,
    rollout_fn_factory: Optional[RolloutFnFactory] = None,
    rows: Optional[Rows] = None,
    rollout_extras: Optional[dict[str, Any]] = None,
) -> dict[str, Any]:
    """Set up, run ``loop_cls(ctx).run()`` to the end, export, always stop the deployment.

    ``rows`` default to ``cfg.dataset``, ``rollout_fn_factory`` to the built-in single-turn rollout
    (``resources.py``). Returns ``{"steps", "last_metrics", "final_model", "output_model", "log_path"}``
    (``output_model``: the promoted folder, when ``cfg.output_model_id`` is set; ``log_path``: the folder the run
    wrote to, see ``if_log_path_exists``). Rank 0 ends with the run's summary (``training/utils/run_summary.py``). Under ``torchrun`` the
    ranks other than 0 follow rank 0 and return ``{"steps": <rank 0's steps>, "last_metrics": {},
    "final_model": None}``.
    """
    with _sigterm_as_exit():
        try:
            return _run_recipe(loop_cls, cfg, rollout_fn_factory, rows, rollout_extras)
        except DeploymentStartError as e:  # one line naming the server's log, not a traceback
            raise SystemExit(f"run stopped: {e.summary}") from None
        except KeyboardInterrupt:  # Ctrl-C: the run said what it saved (stopped_line); no traceback
            raise SystemExit(128 + signal.SIGINT) from None


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
    log_path = None
    try:
        check_run_inputs(cfg)  # a bad base_model or a missing tracker package fails here, in seconds
        rows = resolve_rows(cfg, rows)
        rollout_fn_factory = resolve_rollout_factory(cfg, rollout_fn_factory)
        eval_rows = load_rows(cfg.eval_rows) if cfg.eval_rows is not None else []
        model_path = resolve_model(cfg.base_model)
        log_path = choose_log_path(cfg, main_rank)
        cfg = resolve_engines(replace(cfg, log_path=str(log_path)), main_rank)  # config.json keeps them as given
        cfg = plan_run(cfg, model_path)
        t_start = time.perf_counter()
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
            teacher = None
            try:
                # the teacher scores while the trainer waits: it takes the trainer's share of the cores
                teacher = start_teacher(cfg, log_path, state.tokenizer, share.trainer_threads_busy if share else None)
                result = run_loop(  # never waits for abandoned rollout threads or tasks at exit
                    _run_loop(
                        loop_cls, cfg, rows, eval_rows, log_path, state, deployment, setup, rollout_fn, share, teacher
                    )
                )
                steps = result["steps"]
                final = None
                if cfg.export_final_model:
                    final = state.trainer.save_pretrained(log_path / "final")
                result["final_model"] = str(final) if final else None
                result["output_model"] = (
                    str(promote_final_model(final, cfg, log_path)) if final and cfg.output_model_id else None
                )
                result["log_path"] = str(log_path)
                log_summary(log_path, run_summary(log_path, result, state.start_step, time.perf_counter() - t_start))
                return result
            finally:
                if teacher is not None:
                    teacher.stop()
                deployment.stop()
        finally:
            dist.stop_followers(steps)
    except USER_ERRORS as e:  # a train.py command line prints it in one line; the traceback goes to error.log
        mark_user_error(e, log_path)
        raise
    except (KeyboardInterrupt, SystemExit) as e:
        if log_path is not None and main_rank and (isinstance(e, KeyboardInterrupt) or e.code == 128 + signal.SIGTERM):
            logger.warning(stopped_line(log_path))
        raise
    finally:
        if started:
            dist.shutdown_distributed()


def stopped_line(log_path: Path) -> str:
    """What a run stopped by Ctrl-C / SIGTERM says last: the checkpoint a rerun resumes from, or that there is none."""
    checkpoint = latest_checkpoint(log_path / "checkpoints")
    if checkpoint is None and checkpoint_folders(log_path / "checkpoints"):
        return (
            f"run stopped; none of the checkpoints in {log_path / 'checkpoints'} can be resumed from, so the same "
            "command stops naming why; delete that folder to start over, or use another log_path"
        )
    if checkpoint is None:
        return f"run stopped; {log_path} holds no checkpoint (dcp_save_interval), so the same command starts over"
    return f"run stopped; the same command resumes it from {checkpoint} (if_log_path_exists=resume_or_new)"


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
    teacher: Optional[Teacher] = None,
) -> dict[str, Any]:
    ctx = RunContext(cfg, rows, eval_rows, log_path, state, deployment, setup, rollout_fn, teacher)
    if share is not None:
        ctx.share_cpu(share)
    watchdog = loop_watch.LoopWatchdog().start()  # names loop-blocking rollout code; stalls do not time out rollouts
    try:
        return await loop_cls(ctx).run()
    finally:
        watchdog.stop()
        ctx.close()
        await deployment.close_sampler()
        if teacher is not None:
            await teacher.close_sampler()
