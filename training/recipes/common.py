"""The pieces both recipes share: set-up, group acceptance, weight sync, eval, checkpoints.

``RunContext`` owns the long-lived parts of a run (trainer, reference model, deployment,
sampler, rollout function, data cursor, metrics) and the operations on them; the recipes
own only the order in which they happen.

Under ``torchrun`` every rank builds the same ``RunContext`` and trainer (sharded with FSDP2);
rank 0 runs the recipe and is the only one to start the deployment, roll out, log and write
metrics; the other ranks run ``RunContext.follow``, taking part in each training step, weight
gather, checkpoint and export that rank 0 announces (``training/trainer/distributed.py``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import random
import time
from pathlib import Path
from typing import Any, Callable, Optional

import aiohttp
import torch

from training.models import resolve_model
from training.recipes.config import Config
from training.utils.dist import Command, follow, lead
from training.utils.checkpoint import latest_checkpoint, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from training.utils.data import Rows, RowCursor, load_rows
from training.utils.metrics import MetricsLogger
from training.utils.rl.groups import PromptGroup, run_group
from training.utils.rl.losses import needs_reference_logprobs
from training.utils.rl.ppo import receive_and_train
from training.utils.rl.rollout import RolloutFn, RolloutSetup

logger = logging.getLogger("training.recipe")

RolloutFnFactory = Callable[[RolloutSetup], RolloutFn]


class RolloutFailureError(RuntimeError):
    """Too many rollouts of a step failed: the run stops instead of training on what is left."""


class StepCounters:
    """Rollout outcomes since the last step (what ``rollout/*`` reports)."""

    def __init__(self):
        self.attempts = self.failures = self.errors = self.timeouts = self.invalid = self.dropped = 0
        self.groups_done = self.filtered_groups = self.small_groups = 0
        self.generated_tokens = 0

    def add(self, g: PromptGroup) -> None:
        self.attempts += g.attempts
        self.failures += g.failures
        self.errors += g.errors
        self.timeouts += g.timeouts
        self.invalid += g.invalid
        self.dropped += g.dropped
        self.groups_done += 1
        self.generated_tokens += sum(s.num_trainable_tokens for s in g.samples)

    def metrics(self) -> dict[str, float]:
        return {
            "rollout/attempts": float(self.attempts), "rollout/errors": float(self.errors),
            "rollout/timeouts": float(self.timeouts), "rollout/invalid": float(self.invalid),
            "rollout/returned_none": float(self.dropped), "rollout/filtered_groups": float(self.filtered_groups),
            "rollout/too_small_groups": float(self.small_groups),
            "rollout/generated_tokens": float(self.generated_tokens),
        }


class RunContext:
    """Set-up and shared operations of one RL run."""

    def __init__(self, cfg: Config, rows: Rows, rollout_fn_factory: RolloutFnFactory,
                 rollout_extras: Optional[dict[str, Any]] = None):
        self.cfg = cfg
        self.rows = load_rows(rows)
        self.eval_rows = load_rows(cfg.eval_rows) if cfg.eval_rows is not None else []
        self.rollout_fn_factory = rollout_fn_factory
        self.rollout_extras = rollout_extras or {}
        self.model_path = resolve_model(cfg.base_model)
        """``base_model`` as a loadable path or hub id (``tiny`` and ``smollm2`` are offline aliases)."""
        self.log_path = Path(cfg.log_path)
        self.log_path.mkdir(parents=True, exist_ok=True)
        self.cursor = RowCursor(len(self.rows), cfg.epochs, cfg.seed, cfg.shuffle_rows)
        per_step = cfg.prompt_groups_per_step
        data_steps = max(1, self.cursor.total // per_step)
        self.total_steps = cfg.max_steps or data_steps
        """Planned steps; a run whose rows run out first (filtering) stops early."""
        self.start_step = 0
        self.counters = StepCounters()
        self.semaphore: Optional[asyncio.Semaphore] = None
        self.exit_stack = contextlib.ExitStack()
        self._dist_sender = None

    # ---- set-up -------------------------------------------------------------------------
    def build_trainer(self) -> None:
        """Load the policy (and the frozen reference when kl_beta > 0), resume if a checkpoint exists."""
        from training.trainer import PolicyTrainer, ReferenceModel

        random.seed(self.cfg.seed)
        torch.manual_seed(self.cfg.seed)
        self.trainer = PolicyTrainer(self.model_path, self.cfg.trainer)
        self.tokenizer = self.trainer.tokenizer
        self.vocab_size = self.trainer.model.get_input_embeddings().weight.shape[0]
        self.reference = None
        if needs_reference_logprobs(self.cfg.loss):  # with LoRA: the policy's own base weights, adapters off
            self.reference = (self.trainer.base_reference() if self.trainer.lora
                              else ReferenceModel(self.model_path, self.cfg.trainer))
        ckpt = latest_checkpoint(self.log_path / "checkpoints")
        if ckpt is not None:
            state = load_checkpoint(ckpt, self.trainer.model, self.trainer.optimizer)
            self.start_step = int(state["step"])
            self.cursor.load_state(state["cursor"])
            set_rng_state(state["rng"])
            logger.info("resumed from %s at step %d", ckpt, self.start_step)

    def start_deployment(self) -> None:
        """Start the server(s) of ``deployment.engine`` (or attach to ``deployment.base_url``), build the sampler."""
        from training.deployment.launcher import make_deployment, make_sampler

        dcfg = self.cfg.deployment
        self.deployments = []
        """The servers this run started (empty when attached to external ones)."""
        self.attached_deployments = []
        """vLLM / SGLang adapters of external servers (weight sync through their own endpoints)."""
        if dcfg.base_url is None:
            for i in range(dcfg.num_replicas):
                name = "deployment.log" if dcfg.num_replicas == 1 else f"deployment-{i}.log"
                log_file = dcfg.log_file or str(self.log_path / name)
                if dcfg.log_file and dcfg.num_replicas > 1:
                    log_file = f"{dcfg.log_file}.{i}"
                self.deployments.append(self.exit_stack.enter_context(
                    make_deployment(self.model_path, dcfg, log_file=log_file)))
            self.base_urls = [d.base_url for d in self.deployments]
        else:
            self.base_urls = [dcfg.base_url] if isinstance(dcfg.base_url, str) else list(dcfg.base_url)
            if dcfg.engine != "embedded":
                self.attached_deployments = [self.exit_stack.enter_context(
                    make_deployment(self.model_path, dcfg, base_url=u)) for u in self.base_urls]
        self.sampler = make_sampler(self.base_urls, dcfg, tokenizer=self.tokenizer)
        sampling = {"max_tokens": self.cfg.max_tokens, "temperature": self.cfg.temperature, **self.cfg.sampling_kwargs}
        self.setup = RolloutSetup(sampler=self.sampler, tokenizer=self.tokenizer, sampling_kwargs=sampling,
                                  extras=self.rollout_extras, max_seq_len=dcfg.max_model_len)
        self.rollout_fn = self.rollout_fn_factory(self.setup)
        if not callable(self.rollout_fn):
            raise TypeError("rollout_fn_factory(setup) must return an async function rollout_fn(row)")

    @property
    def weight_sync_mode(self) -> str:
        mode = self.cfg.deployment.weight_sync
        if mode == "auto":
            return "shm" if self.cfg.deployment.base_url is None else "disk"
        return mode

    async def sync_weights(self, version: int) -> float:
        """Push the trainer's weights to the deployment as ``version``; return seconds taken.

        Every replica gets the weights before this returns. An embedded deployment keeps the
        pushed file so that a restarted server comes back with the newest weights.
        """
        t0 = time.perf_counter()
        mode = self.weight_sync_mode
        directory = str(self.log_path / "weights") if mode == "disk" else None
        hooks = self.setup.weight_sync_hooks
        for before, _ in hooks:
            await before()
        try:  # returns once every replica serves the new version
            targets = self.deployments or self.attached_deployments
            if mode == "distributed":
                await self.distributed_sender().push(self.trainer.named_weights(), version,
                                                     specs=self.trainer.weight_specs())
            elif targets:
                await asyncio.gather(*(
                    d.push_weights(self.trainer.named_weights(), version, mode=mode,
                                   directory=None if directory is None else f"{directory}/{i}")
                    for i, d in enumerate(targets)))
            else:
                from training.deployment.weight_sync import push_weights_to_all

                await push_weights_to_all(self.base_urls, self.trainer.named_weights(), version, mode=mode,
                                          directory=directory, api_key=self.cfg.deployment.api_key)
            self.sampler.note_weight_version(version)  # labels completions of servers that report none
        finally:
            for _, after in hooks:
                await after()
        return time.perf_counter() - t0

    def distributed_sender(self):
        """The weight sender of ``weight_sync="distributed"``, connected to every server on first use."""
        if self._dist_sender is None:
            from training.deployment.dist_weights import DistributedWeightSender

            d = self.cfg.deployment
            self._dist_sender = DistributedWeightSender(
                self.base_urls, d.weight_sync_master_addr, d.weight_sync_master_port, d.weight_sync_backend,
                api_key=d.api_key, timeout_s=d.request_timeout_s)
            self.exit_stack.callback(self._dist_sender.close)
        return self._dist_sender

    # ---- rollouts ---------------------------------------------------------------------
    @staticmethod
    def is_retryable(error: BaseException) -> bool:
        """A failure of the deployment rather than of the rollout: no connection, or a 5xx."""
        from training.deployment.sampler import DeploymentRequestError

        if isinstance(error, DeploymentRequestError):
            return error.status is None or error.status >= 500
        return isinstance(error, (aiohttp.ClientConnectionError, ConnectionError))

    async def run_group(self, position: int, submit_version: int) -> PromptGroup:
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(self.cfg.max_concurrency)
        row = self.rows[self.cursor.row_index(position)]
        return await run_group(self.rollout_fn, row, position, submit_version, self.cfg.completions_per_prompt,
                               self.cfg.rollout_timeout_s, self.semaphore, self.vocab_size, self.is_retryable)

    def accept_group(self, group: PromptGroup) -> bool:
        """Count the group's outcomes; True if it is kept for training (advantages set)."""
        c = self.counters
        c.add(group)
        if c.attempts >= max(8, 2 * self.cfg.completions_per_prompt) and \
                c.failures / c.attempts > self.cfg.max_rollout_error_fraction:
            raise RolloutFailureError(
                f"{c.failures} of {c.attempts} rollouts failed since the last step ({c.errors} raised, "
                f"{c.timeouts} timed out, {c.invalid} invalid), more than max_rollout_error_fraction="
                f"{self.cfg.max_rollout_error_fraction}; see the warnings above for the rows and errors")
        keep = True
        if len(group.completion_rewards) < 2:
            c.small_groups += 1
            keep = False
        elif self.cfg.dynamic_filter_fn is not None and not self.cfg.dynamic_filter_fn(group.samples):
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

    # ---- eval, checkpoints, metrics -------------------------------------------------
    def eval_due(self, step: int) -> bool:
        """Eval before the first step, every eval_interval steps, and after the last."""
        return bool(self.eval_rows) and self.cfg.eval_interval > 0 and (
            step == 0 or step % self.cfg.eval_interval == 0 or step == self.total_steps)

    async def evaluate(self) -> dict[str, float]:
        """Roll out every eval row once with the deployed weights: eval/reward_mean and eval/pass_rate."""
        if self.semaphore is None:
            self.semaphore = asyncio.Semaphore(self.cfg.max_concurrency)

        async def one(row):
            async with self.semaphore:
                try:
                    result = await asyncio.wait_for(self.rollout_fn(row), self.cfg.rollout_timeout_s)
                except Exception as e:  # noqa: BLE001 - an eval failure scores 0, never stops the run
                    logger.warning("eval rollout raised %s: %s", type(e).__name__, e)
                    return 0.0
                return float(getattr(result, "reward", 0.0)) if result is not None else 0.0

        rewards = await asyncio.gather(*(one(r) for r in self.eval_rows))
        return {"eval/reward_mean": sum(rewards) / len(rewards),
                "eval/pass_rate": sum(1.0 for r in rewards if r > 0) / len(rewards)}

    async def finish_step(self, groups: list[PromptGroup], step_done: int) -> tuple[dict[str, float], float]:
        """After a trained step: mark its rows done, evaluate and checkpoint when due.

        Returns the ``eval/*`` metrics (empty when no eval was due) and the checkpoint's seconds.
        """
        for g in groups:
            self.cursor.mark_done(g.position)
        evals = await self.evaluate() if self.eval_due(step_done) else {}
        ckpt_s = self.save_checkpoint(step_done) if self.checkpoint_due(step_done) else 0.0
        return evals, ckpt_s

    def checkpoint_due(self, step_done: int) -> bool:
        i = self.cfg.dcp_save_interval
        return i > 0 and (step_done % i == 0 or step_done == self.total_steps)

    def save_checkpoint(self, step_done: int) -> float:
        """Write a DCP checkpoint (under torchrun: rank 0 calls this, the other ranks follow)."""
        t0 = time.perf_counter()
        state = {"step": step_done, "weight_version": step_done, "cursor": self.cursor.state(), "rng": rng_state()}
        with lead(Command.CHECKPOINT, step_done):
            save_checkpoint(self.log_path / "checkpoints", step_done, self.trainer.model, self.trainer.optimizer, state)
        return time.perf_counter() - t0

    def follow(self) -> int:
        """Non-zero ranks under torchrun: take part in what rank 0 announces until it stops.

        Returns the argument of rank 0's STOP (the steps it completed). Never starts the
        deployment, rolls out, or writes metrics.
        """
        return follow({
            Command.TRAIN: lambda _: receive_and_train(self.trainer, self.cfg.loss, reference=self.reference),
            Command.WEIGHTS: lambda _: collections.deque(self.trainer.named_weights(), maxlen=0),
            Command.CHECKPOINT: lambda step: save_checkpoint(self.log_path / "checkpoints", step, self.trainer.model,
                                                             self.trainer.optimizer, None),
            Command.EXPORT: lambda _: self.trainer.save_pretrained(self.log_path / "final"),
        })

    def open_metrics(self) -> MetricsLogger:
        self.metrics = MetricsLogger(self.log_path, self.total_steps, self.cfg.wandb, self.cfg.to_dict(),
                                     resume_step=self.start_step)
        return self.metrics

    def finish(self) -> Optional[Path]:
        """Export the final policy (when configured); returns its folder."""
        if not self.cfg.export_final_model:
            return None
        out = self.log_path / "final"
        self.trainer.save_pretrained(out)
        return out

    async def sampler_close(self) -> None:
        if getattr(self, "sampler", None) is not None:
            await self.sampler.close()

    def close(self) -> None:
        """Stop the embedded deployment (also on errors and Ctrl-C)."""
        self.exit_stack.close()


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
