"""``Config`` of the RL recipes (``async_rl_loop`` and ``rl_loop``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

from training.utils.config import DeployConfig, TrainerConfig, WandBConfig
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.rollout import RolloutSample

STALL_GRACE_S = 120.0
"""A waiting trainer stops the run when no rollout finished for ``rollout_timeout_s`` plus this long
(a rollout cannot legitimately take longer; a dead deployment would otherwise hang the run)."""
WAIT_POLL_S = 5.0
"""How often a trainer that waits for rollouts re-checks for that stall."""
ERROR_CHECK_MIN_ATTEMPTS = 8
"""``max_rollout_error_fraction`` is checked once a step has this many attempts (and at least two
groups' worth), so one early failure cannot stop a run."""


@dataclass
class Config:
    """Everything a run needs besides the rows and the rollout function.

    The optimizer (``trainer.learning_rate``) and the policy loss (``loss.policy_loss``,
    ``loss.kl_beta``) live in their sub-configs, so every field is declared once.
    """

    base_model: str
    """A hub id or local folder that ``AutoModelForCausalLM.from_pretrained`` loads, or ``tiny`` / ``smollm2`` (built offline)."""
    log_path: str = "runs/default"
    """Folder for metrics.jsonl, checkpoints, the deployment log and the final model. Rerunning with the same folder resumes."""
    completions_per_prompt: int = 4
    """Rollouts per row (the group size for group-relative advantages); at least 2."""
    prompt_groups_per_step: int = 8
    """Prompt groups (rows) per training step."""
    max_head_offpolicy_versions: int = 0
    """O: a sample may be trained at most O weight versions after the version it was submitted under (0 = strict on-policy)."""
    synchronous_training: bool = False
    """Drain every in-flight rollout before each step and submit nothing while training."""
    weight_sync_interval: int = 1
    """Push weights to the deployment every this many steps (needs max_head_offpolicy_versions >= interval - 1)."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    ppo_mini_batches: int = 1
    """Optimizer steps per pass; clipping only acts when ppo_epochs * ppo_mini_batches > 1."""
    advantage_std_scaling: bool = True
    """Divide group-centred rewards by the group's std (False: Dr. GRPO mean-centring only)."""
    max_tokens: int = 256
    """Default completion length limit passed to the sampler."""
    temperature: float = 1.0
    """Sampling temperature; the trainer computes its logprobs at the same temperature."""
    sampling_kwargs: dict[str, Any] = field(default_factory=dict)
    """More sampler defaults (top_p, stop, ...), handed to rollout_fn through RolloutSetup."""
    max_concurrency: int = 64
    """Rollouts in flight at once."""
    rollout_timeout_s: float = 600.0
    """A rollout that takes longer is cancelled and counted in rollout/timeouts."""
    max_rollout_error_fraction: float = 0.5
    """Stop the run when more than this fraction of a step's rollouts failed (errors, timeouts, invalid)."""
    dynamic_filter_fn: Optional[Callable[[list[RolloutSample]], bool]] = None
    """Keep a group only if this returns True (e.g. drop groups whose rewards are all equal)."""
    max_steps: Optional[int] = None
    """Stop after this many steps; None = when the data (epochs passes over the rows) runs out."""
    epochs: int = 1
    """Passes over the rows."""
    shuffle_rows: bool = True
    """Shuffle the rows each epoch (seeded)."""
    eval_rows: Optional[Union[list, str]] = None
    """Held-out rows (list or .jsonl path); each is rolled out once at every eval."""
    eval_interval: int = 0
    """Evaluate before training, every this many steps and at the end (0 = never)."""
    dcp_save_interval: int = 0
    """Write a DCP checkpoint every this many steps (0 = off; a final one is written when > 0)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted after each write)."""
    export_final_model: bool = True
    """Save the final policy as a Hugging Face folder in <log_path>/final."""
    seed: int = 0
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    deployment: DeployConfig = field(default_factory=DeployConfig)
    wandb: WandBConfig = field(default_factory=WandBConfig)

    def __post_init__(self):
        def check(cond: bool, name: str, msg: str):
            if not cond:
                raise ValueError(f"{name}: {msg}")

        check(isinstance(self.base_model, str) and self.base_model != "", "base_model", "must be a hub id or a folder")
        check(self.completions_per_prompt >= 2, "completions_per_prompt",
              f"must be >= 2 (group-relative advantages need a group), got {self.completions_per_prompt}")
        check(self.prompt_groups_per_step >= 1, "prompt_groups_per_step", "must be >= 1")
        check(self.max_head_offpolicy_versions >= 0, "max_head_offpolicy_versions", "must be >= 0")
        check(self.weight_sync_interval >= 1, "weight_sync_interval", "must be >= 1")
        check(self.max_head_offpolicy_versions >= self.weight_sync_interval - 1, "max_head_offpolicy_versions",
              f"must be >= weight_sync_interval - 1 = {self.weight_sync_interval - 1}: samples from a deployment "
              "that lags the trainer by interval - 1 versions would otherwise never be fresh enough")
        check(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        check(self.ppo_mini_batches >= 1, "ppo_mini_batches", "must be >= 1")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 for RL sampling")
        check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        check(self.rollout_timeout_s > 0, "rollout_timeout_s", "must be > 0")
        check(0 < self.max_rollout_error_fraction <= 1, "max_rollout_error_fraction", "must be in (0, 1]")
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1 or None")
        check(self.epochs >= 1, "epochs", "must be >= 1")
        check(self.eval_interval >= 0, "eval_interval", "must be >= 0")
        check(self.dcp_save_interval >= 0, "dcp_save_interval", "must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        for name, cls in (("trainer", TrainerConfig), ("loss", LossConfig), ("deployment", DeployConfig),
                          ("wandb", WandBConfig)):
            check(isinstance(getattr(self, name), cls), name, f"must be a {cls.__name__}")

    @property
    def error_check_min_attempts(self) -> int:
        """Attempts a step needs before ``max_rollout_error_fraction`` is checked (see the constant)."""
        return max(ERROR_CHECK_MIN_ATTEMPTS, 2 * self.completions_per_prompt)

    @property
    def stall_timeout_s(self) -> float:
        """Seconds without any finished rollout after which a waiting trainer stops the run."""
        return self.rollout_timeout_s + STALL_GRACE_S

    def to_dict(self) -> dict:
        """A JSON-able view (callables by name) for logs and wandb."""
        d = asdict(self)
        d["dynamic_filter_fn"] = getattr(self.dynamic_filter_fn, "__name__", None)
        if callable(self.loss.policy_loss):
            d["loss"]["policy_loss"] = getattr(self.loss.policy_loss, "__name__", "custom")
        return d
