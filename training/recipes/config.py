"""``Config`` of the RL recipes (``async_rl_loop`` and ``rl_loop``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, ClassVar, Optional, Union

from training.utils.config import ConfigError, DeployConfig, ProxyConfig, TensorBoardConfig, TrainerConfig, WandBConfig
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS
from training.utils.rl.distillation import DistillationConfig
from training.utils.rl.gate import STALE_POLICIES
from training.utils.rl.losses.config import LossConfig
from training.utils.run_record import IF_EXISTS
from training.utils.rl.group_reward import GroupRewardFn
from training.utils.rl.groups import PromptGroup
from training.utils.rl.critic_config import CriticConfig
from training.utils.rl.overlong import OverlongConfig
from training.utils.rl.rollout import COMPONENT_NAME

STALL_GRACE_S = 120.0
"""A waiting trainer stops the run when no rollout finished for ``rollout_timeout_s`` plus this long
(a rollout cannot legitimately take longer; a dead deployment would otherwise hang the run)."""
WAIT_POLL_S = 5.0
"""How often a trainer that waits for rollouts re-checks for that stall."""
RESUME_MAY_CHANGE = (
    "log_path",
    "max_steps",
    "epochs",
    "eval_interval",
    "sample_print_interval",
    "mismatch_probe_threshold",
    "dcp_save_interval",
    "keep_checkpoints",
    "export_final_model",
    "output_model_id",
    "resume_with_changed_config",
    "if_log_path_exists",
    "show_experimental_notice",
    "deployment",
    "distillation.deployment",
    "trainer.gradient_checkpointing",
    "wandb",
    "tensorboard",
    "proxy",
)
"""Settings a resumed run may change without ``resume_with_changed_config`` (they do not change what
is trained: how long, how it is logged and served, whether activations are recomputed, the proxy's deadlines)."""
DISTILLATION_LOSS = LossConfig(policy_loss="importance_sampling", kl_beta=0.0)
"""The loss of a distillation run whose ``loss`` is left unset: no ``policy_loss`` given (in either spelling; an
explicit ``"grpo"`` counts as given, ``LossConfig.policy_loss_given``) and the rest of ``loss`` at its defaults. It is
the unclipped policy gradient with the train/inference correction, no reference model (why:
``training/utils/rl/distillation.py``). Any other ``loss`` is kept as given (``Config(policy_loss="grpo",
distillation=...)`` trains grpo, with ``kl_beta`` as given or its default)."""
RECORDED_WHEN_SET = {
    "aggregation_constant": None,
    "mis_level": "off",
    "mis_low": None,
    "mis_high": 2.0,
    "kl_estimator": "k3",
    "kl_in_reward": False,
    "reference_refresh_interval": 0,
}
"""``loss.*`` settings ``to_dict`` leaves out at these defaults (added after runs were recorded: such a run resumes)."""
TOP_RECORDED_WHEN_SET = {
    "advantage": None,
    "reward_weights": None,
    "overlong": asdict(OverlongConfig()),
    "critic": asdict(CriticConfig()),
    "proxy": asdict(ProxyConfig()),
    "mismatch_probe_threshold": 0.05,
}
"""The same for top-level settings (``overlong``, ``critic`` and ``proxy`` as ``asdict`` records them)."""
ERROR_CHECK_MIN_ATTEMPTS = 8
"""``max_rollout_error_fraction`` is checked once a step has this many attempts (and at least two
groups' worth), so one early failure cannot stop a run."""


@dataclass
class Config:
    """Everything a run needs besides the rows and the rollout function.

    The optimizer (``trainer.learning_rate``) and the policy loss (``loss.policy_loss``,
    ``loss.kl_beta``) live in their sub-configs. The top-level ``learning_rate``, ``policy_loss``
    and ``kl_beta`` (the spellings of the Fireworks cookbook's documentation) are the same three
    settings, not copies: after construction each alias holds its nested field's value; giving
    both spellings different values is an error naming both (a value equal to the field's
    default counts as not given); ``key=value`` accepts either spelling (``CLI_ALIASES``);
    ``to_dict`` (logs, wandb) and ``--help`` show the nested field once.
    """

    CLI_ALIASES: ClassVar[dict[str, str]] = {
        "learning_rate": "trainer.learning_rate",
        "policy_loss": "loss.policy_loss",
        "kl_beta": "loss.kl_beta",
    }

    base_model: str
    """A hub id or local folder that ``AutoModelForCausalLM.from_pretrained`` loads, or ``tiny`` / ``smollm2`` (built offline)."""
    log_path: str = "runs/default"
    """Folder for metrics.jsonl, checkpoints, the deployment log and the final model. What a rerun into a folder that holds a run does: ``if_log_path_exists``."""
    if_log_path_exists: str = "resume_or_new"
    """When ``log_path`` holds a run: ``resume_or_new`` resumes it if it has a checkpoint and the same training settings
    (config.json), else writes to a new numbered folder beside it (``runs/x-2``; the log says so); ``resume``: resume
    or refuse; ``new``: always a free numbered folder; ``overwrite``: delete the old run; ``error``: refuse."""
    learning_rate: Optional[float] = None
    """The same setting as ``trainer.learning_rate`` (either spelling)."""
    policy_loss: Optional[Union[str, Callable]] = None
    """The same setting as ``loss.policy_loss`` (either spelling)."""
    kl_beta: Optional[float] = None
    """The same setting as ``loss.kl_beta`` (either spelling)."""
    dataset: Optional[str] = None
    """A .jsonl file of rows, used when ``main`` is given no ``rows``."""
    max_rows: Optional[int] = None
    """Use only the first this many rows (of ``rows`` or ``dataset``); None = all."""
    reward_fn: Optional[Callable[[str, dict], float]] = None
    """Reward of the built-in single-turn rollout (``main`` without ``rollout_fn_factory``):
    ``fn(completion_text, row)``; None = exact match against the row's ``answer`` (``single_turn.py``)."""
    completions_per_prompt: int = 4
    """Rollouts per row (the group size for group-relative advantages); at least 2."""
    prompt_groups_per_step: int = 8
    """Prompt groups (rows) per training step."""
    max_head_offpolicy_versions: int = 0
    """O: a sample may be trained at most O weight versions after the version it was submitted under (0 = strict on-policy)."""
    synchronous_training: Optional[bool] = None
    """Drain every in-flight rollout before each step and submit nothing while training. None = True with
    ``deployment.colocate`` (the engine sleeps while the trainer trains), else False; False with
    ``deployment.colocate`` is an error. What the run does: ``trains_synchronously``."""
    weight_sync_interval: int = 1
    """Push weights to the deployment every this many steps, and before each eval (needs max_head_offpolicy_versions
    >= interval - 1)."""
    # -- off-policy pacing (async_rl_loop; see training/utils/rl/gate.py for the bound and the window) --
    stale_policy: str = "wait"
    """``wait``: the trainer waits for the oldest groups so every rollout is trained within the bound (nothing dropped);
    ``drop``: never wait, drop a group that finished past the bound and requeue its row."""
    inflight_weight_updates: bool = False
    """Push weights without draining the deployment: running sequences continue under the new weights from the next
    decode step (PipelineRL). False: a push waits until running sequences finish on the old weights."""
    ppo_epochs: int = 1
    """Passes over each step's samples."""
    ppo_mini_batches: int = 1
    """Optimizer steps per pass; clipping only acts when ppo_epochs * ppo_mini_batches > 1."""
    advantage_std_scaling: bool = True
    """The older switch of ``advantage``: False is ``advantage="dr_grpo"`` (mean-centring only); kept working."""
    advantage: Optional[str] = None
    """The advantage estimator (``training.utils.rl.advantages.ADVANTAGE_ESTIMATORS``): ``grpo`` (std-normalised, the
    default), ``dr_grpo`` (mean-centred), ``rloo`` (leave-one-out baseline), ``reinforce_pp`` (group-centred, divided
    by the std over the step batch); formulas in ``training/utils/rl/advantages.py``. None = ``grpo``, or ``dr_grpo``
    with ``advantage_std_scaling=False``; the run reads the resolved name, ``advantage_estimator``."""
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
    dynamic_filter_fn: Optional[Callable[[PromptGroup], bool]] = None
    """Keep a group only if ``fn(pg)`` returns True (a dropped group's row is marked done, never trained).
    ``training.utils.rl.filters.has_learning_signal`` drops the groups whose samples would all get the same advantage,
    per-call credit included; ``lambda pg: len(set(pg.rewards)) > 1`` looks only at the returns (``pg.rewards``) and
    also drops a group whose calls differ while its returns are equal. ``pg`` also iterates as its samples. With
    distillation it runs after the teacher has scored the group (``RunContext.distill``), on its per-token advantages."""
    group_reward_fn: Optional[GroupRewardFn] = None
    """``async fn(pg)``, awaited on every finished training group before it is counted and filtered: sets the rewards
    of its completions from all of them together (a judge that ranks the group: ``training.rewards``); if it raises,
    the group is dropped and its completions counted as failed under the error's cause
    (``training/utils/rl/group_reward.py``). Eval rollouts keep the reward their ``rollout_fn`` returned."""
    reward_weights: Optional[dict[str, float]] = None
    """Multi-reward: ``{name: weight}`` over the ``reward_components`` the rollouts return. Each completion then trains
    on sum_c w_c · (r_c - mean_G r_c) / (std_G r_c + 1e-4), its components normalised within its group, and the
    ``advantage`` estimator runs on that sum; a returned component without a weight counts 0. None = train on the
    returned ``reward`` (components only logged: ``rollout/reward/<name>_mean``). ``training/utils/rl/reward_components.py``."""
    overlong: OverlongConfig = field(default_factory=OverlongConfig)
    """DAPO's overlong shaping (``overlong.*``): a soft length penalty up to ``overlong.max_tokens`` over a window of
    ``overlong.buffer_tokens``, and ``overlong.filter_truncated`` to keep cut-off completions out of training; off
    by default (``training/utils/rl/overlong.py``)."""
    critic: CriticConfig = field(default_factory=CriticConfig)
    """PPO's critic for ``advantage="gae"`` (``critic.*``: gamma, lam, value_loss_coef, value_clip, learning_rate,
    whiten): a value head on the policy's hidden states trained beside it (``training/utils/rl/gae.py``). Setting it
    with any other estimator is an error."""
    max_steps: Optional[int] = None
    """Stop after this many steps; None = when the data (epochs passes over the rows) runs out."""
    epochs: int = 1
    """Passes over the rows."""
    shuffle_rows: bool = True
    """Shuffle the rows each epoch (seeded)."""
    eval_rows: Optional[Union[list, str]] = None
    """Held-out rows (list or .jsonl path); each is rolled out once at every eval."""
    eval_interval: int = 0
    """Evaluate before training, every this many steps and at the end (0 = never), on the weights of that step (they
    are pushed first)."""
    sample_print_interval: int = 10
    """Print one sampled completion with its reward and prompt to the console every this many steps, from step 0
    (0 = never); ``rollouts.jsonl`` has every sample either way."""
    mismatch_probe_threshold: Optional[float] = 0.05
    """When a step's ``train/logprob_diff_mean`` (engine vs trainer, per trained token) passes this, the next step
    re-scores a few on-policy samples in ways that isolate the cause and warns once with the numbers
    (training/utils/rl/mismatch_probe.py); None = never."""
    dcp_save_interval: int = 0
    """Write a DCP checkpoint every this many steps (0 = off; a final one is written when > 0)."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep (older ones are deleted after each write)."""
    export_final_model: bool = True
    """Save the final policy as a Hugging Face folder in <log_path>/final."""
    show_experimental_notice: Optional[bool] = None
    """``async_rl_loop``'s "experimental" warning: None = once per installation (a marker in the cache folder), True =
    every run, False = never."""
    resume_with_changed_config: bool = False
    """Resume from a checkpoint even when training settings differ from <log_path>/config.json (the differences are logged)."""
    output_model_id: Optional[str] = None
    """Promote the final policy under this name: the exported folder is copied to <log_path>/<output_model_id>, or to
    this path when it contains a '/'; the log says where. None = no promotion."""
    seed: int = 0
    """Seed of the run: the row shuffle, torch's RNG, each step's PPO mini-batch order (``seed + step``), each training
    completion's sampling seeds (derived from it, the submit version, the row's position and the completion index:
    ``training/utils/rl/request_seeds.py``) and the server's own generators for other requests (when
    ``deployment.engine_config.seed`` is None)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The policy trainer: optimizer, learning-rate schedule, device, micro-batches, LoRA (``trainer.*``)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """The policy loss and its parameters (``loss.*``)."""
    deployment: DeployConfig = field(default_factory=DeployConfig)
    """The inference deployment the rollouts sample from, with its engine settings (``deployment.*``)."""
    wandb: WandBConfig = field(default_factory=WandBConfig)
    """Weights & Biases logging (``wandb.*``); off unless ``wandb.project`` or ``WANDB_PROJECT`` is set."""
    tensorboard: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard scalars (``tensorboard.*``); off unless ``tensorboard.enabled``."""
    proxy: ProxyConfig = field(default_factory=ProxyConfig)
    """The deadlines of the recording proxy a ``make_proxy_rollout_fn`` rollout starts (``proxy.*``:
    ``stream_write_timeout_s``, ``drain_timeout_s``; ``training/proxy/README.md``, "Limits")."""
    distillation: DistillationConfig = field(default_factory=DistillationConfig)
    """On-policy distillation from a teacher (``distillation.*``); off unless ``distillation.teacher_model`` or
    ``distillation.deployment.base_url`` is set. With it on, a loss left unset (no ``policy_loss`` given, the rest
    of ``loss`` at its defaults) becomes ``importance_sampling`` without a reference model (``DISTILLATION_LOSS``)."""

    def __post_init__(self):
        def check(cond: bool, name: str, msg: str):
            if not cond:
                raise ConfigError(f"{name}: {msg}")

        check(isinstance(self.base_model, str) and self.base_model != "", "base_model", "must be a hub id or a folder")
        check(
            self.completions_per_prompt >= 2,
            "completions_per_prompt",
            f"must be >= 2 (group-relative advantages need a group), got {self.completions_per_prompt}",
        )
        check(self.prompt_groups_per_step >= 1, "prompt_groups_per_step", "must be >= 1")
        check(self.max_head_offpolicy_versions >= 0, "max_head_offpolicy_versions", "must be >= 0")
        check(self.weight_sync_interval >= 1, "weight_sync_interval", "must be >= 1")
        check(
            self.max_head_offpolicy_versions >= self.weight_sync_interval - 1,
            "max_head_offpolicy_versions",
            f"must be >= weight_sync_interval - 1 = {self.weight_sync_interval - 1}: samples from a deployment "
            "that lags the trainer by interval - 1 versions would otherwise never be fresh enough",
        )
        check(
            self.stale_policy in STALE_POLICIES, "stale_policy", f"{self.stale_policy!r} is not one of {STALE_POLICIES}"
        )
        check(
            self.synchronous_training is None or isinstance(self.synchronous_training, bool),
            "synchronous_training",
            "must be true, false or null",
        )
        check(
            not (self.deployment.colocate and self.synchronous_training is False),
            "synchronous_training",
            "synchronous_training=False and deployment.colocate=True conflict: a colocated engine sleeps while the "
            "trainer trains, so rollouts cannot overlap training; leave synchronous_training unset (or True)",
        )
        check(
            not (self.deployment.colocate and self.deployment.sleep_level == 2 and self.weight_sync_interval != 1),
            "weight_sync_interval",
            "must be 1 with deployment.colocate and sleep_level=2: a replica that slept at level 2 gets its weights "
            "back from the push after every step",
        )
        check(self.ppo_epochs >= 1, "ppo_epochs", "must be >= 1")
        check(self.ppo_mini_batches >= 1, "ppo_mini_batches", "must be >= 1")
        check(self.max_tokens >= 1, "max_tokens", "must be >= 1")
        check(self.temperature > 0, "temperature", "must be > 0 for RL sampling")
        check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        check(self.rollout_timeout_s > 0, "rollout_timeout_s", "must be > 0")
        check(0 < self.max_rollout_error_fraction <= 1, "max_rollout_error_fraction", "must be in (0, 1]")
        check(
            self.group_reward_fn is None or callable(self.group_reward_fn),
            "group_reward_fn",
            f"must be an async function of a PromptGroup, or None; got {self.group_reward_fn!r}",
        )
        check(
            self.reward_weights is None
            or (
                isinstance(self.reward_weights, dict)
                and self.reward_weights
                and all(
                    isinstance(k, str)
                    and COMPONENT_NAME.fullmatch(k)
                    and isinstance(w, (int, float))
                    and not isinstance(w, bool)
                    and math.isfinite(w)
                    for k, w in self.reward_weights.items()
                )
            ),
            "reward_weights",
            "must be None or a non-empty dict of component name (letters, digits, '_', '.', '-') -> finite weight, "
            f"got {self.reward_weights!r}",
        )
        check(self.max_steps is None or self.max_steps >= 1, "max_steps", "must be >= 1 or None")
        check(self.epochs >= 1, "epochs", "must be >= 1")
        check(self.eval_interval >= 0, "eval_interval", "must be >= 0")
        check(
            self.if_log_path_exists in IF_EXISTS,
            "if_log_path_exists",
            f"{self.if_log_path_exists!r} is not one of {IF_EXISTS}",
        )
        check(self.dcp_save_interval >= 0, "dcp_save_interval", "must be >= 0")
        check(
            isinstance(self.sample_print_interval, int) and self.sample_print_interval >= 0,
            "sample_print_interval",
            f"must be an int >= 0 (0 = never), got {self.sample_print_interval!r}",
        )
        check(
            self.mismatch_probe_threshold is None
            or (isinstance(self.mismatch_probe_threshold, (int, float)) and self.mismatch_probe_threshold > 0),
            "mismatch_probe_threshold",
            f"must be a number > 0 or None (never), got {self.mismatch_probe_threshold!r}",
        )
        check(self.keep_checkpoints >= 1, "keep_checkpoints", f"must be >= 1, got {self.keep_checkpoints}")
        check(self.max_rows is None or self.max_rows >= 1, "max_rows", f"must be >= 1 or None, got {self.max_rows}")
        check(
            self.dataset is None or (isinstance(self.dataset, str) and self.dataset != ""),
            "dataset",
            "must be the path of a .jsonl file, or None",
        )
        check(
            self.output_model_id is None or (isinstance(self.output_model_id, str) and self.output_model_id.strip()),
            "output_model_id",
            "must be a non-empty name or path, or None",
        )
        check(
            self.output_model_id is None or self.export_final_model,
            "output_model_id",
            "promotes the exported final model: needs export_final_model=True",
        )
        if self.trainer.lr_schedule != "constant":  # the decay ends at the run's last optimizer step
            check(
                self.max_steps is not None,
                "trainer.lr_schedule",
                f"{self.trainer.lr_schedule!r} decays to 0 at the run's end, which needs max_steps; set max_steps, "
                "or use trainer.lr_schedule=constant",
            )
            check(
                self.trainer.warmup_steps < self.optimizer_steps,
                "trainer.warmup_steps",
                f"{self.trainer.warmup_steps} warm-up steps leave nothing of the run's {self.optimizer_steps} "
                f"optimizer steps (max_steps * ppo_epochs * ppo_mini_batches) for the {self.trainer.lr_schedule} decay",
            )
        for name, cls in (
            ("trainer", TrainerConfig),
            ("loss", LossConfig),
            ("deployment", DeployConfig),
            ("wandb", WandBConfig),
            ("tensorboard", TensorBoardConfig),
            ("proxy", ProxyConfig),
            ("distillation", DistillationConfig),
            ("overlong", OverlongConfig),
            ("critic", CriticConfig),
        ):
            check(isinstance(getattr(self, name), cls), name, f"must be a {cls.__name__}")
        check(
            self.advantage is None or self.advantage in ADVANTAGE_ESTIMATORS,
            "advantage",
            f"{self.advantage!r} is not one of {sorted(ADVANTAGE_ESTIMATORS)}",
        )
        check(
            self.advantage_std_scaling or self.advantage in (None, "dr_grpo"),
            "advantage",
            f"advantage={self.advantage!r} and advantage_std_scaling=False conflict (the latter is "
            "advantage='dr_grpo'); set advantage alone",
        )
        check(
            self.critic == CriticConfig() or self.advantage == "gae",
            "critic",
            f"the critic trains only with advantage='gae', not {self.advantage_estimator!r}; set advantage='gae' or "
            "leave critic at its defaults",
        )
        check(
            self.advantage != "gae" or not self.distillation.enabled,
            "advantage",
            "'gae' and distillation both set the per-token advantages; choose one",
        )
        check(
            not (self.loss.reference_refresh_interval and self.trainer.lora_rank > 0),
            "loss.reference_refresh_interval",
            "with LoRA the reference is the policy's own base weights (adapters off): there is no copy to refresh",
        )
        check(
            self.advantage != "gae" or not self.loss.kl_in_reward,
            "loss.kl_in_reward",
            "not built with advantage='gae' (the penalty would have to enter GAE's token rewards); keep the KL in "
            "the loss (kl_in_reward=False) or choose another advantage",
        )
        if self.policy_loss is not None and not self.loss.policy_loss_given:
            self.loss = dataclasses.replace(self.loss, policy_loss=_given(self.policy_loss))  # the alias was given
        self._resolve_aliases()
        if self.distillation.enabled and self.loss == LossConfig() and not self.loss.policy_loss_given:
            self.loss = DISTILLATION_LOSS
            self._resolve_aliases()

    def _resolve_aliases(self) -> None:
        """Make each top-level alias and its nested field one setting (see the class docstring)."""
        for alias, path in self.CLI_ALIASES.items():
            sub_name, leaf = path.split(".")
            sub = getattr(self, sub_name)
            default = next(f.default for f in dataclasses.fields(sub) if f.name == leaf)
            value, nested = getattr(self, alias), getattr(sub, leaf)
            if value is None or value == default:
                setattr(self, alias, nested)
                continue
            if nested != default and nested != value:
                raise ConfigError(
                    f"{alias}: {alias}={_show(value)} and {path}={_show(nested)} are one setting; set one of them"
                )
            if nested != value:
                setattr(self, sub_name, dataclasses.replace(sub, **{leaf: value}))  # a copy, validated again

    @property
    def advantage_estimator(self) -> str:
        """The advantage estimator the run uses: ``advantage`` when given, else ``grpo`` (``dr_grpo`` with
        ``advantage_std_scaling=False``). The one reader of the two fields."""
        if self.advantage is not None:
            return self.advantage
        return "grpo" if self.advantage_std_scaling else "dr_grpo"

    @property
    def optimizer_steps(self) -> Optional[int]:
        """Optimizer steps of the whole run, ``max_steps * ppo_epochs * ppo_mini_batches`` (None without
        ``max_steps``): where ``trainer.lr_schedule`` ends. A step with fewer samples than ``ppo_mini_batches``
        takes fewer; the schedule then ends a little later than planned."""
        return None if self.max_steps is None else self.max_steps * self.ppo_epochs * self.ppo_mini_batches

    @property
    def trains_synchronously(self) -> bool:
        """Whether the loop drains in-flight rollouts before each step and submits none while training:
        ``synchronous_training`` when given, else ``deployment.colocate``. The one reader of the two fields."""
        return self.deployment.colocate if self.synchronous_training is None else self.synchronous_training

    @property
    def rollouts_overlap_training(self) -> bool:
        """Whether ``async_rl_loop`` samples while the trainer trains (``rl_loop`` never does; the CPU split in
        ``resources.cpu_share`` depends on it). The one place this is decided:

        ===================== ======================= ============================= =====================
        synchronous_training  deployment.colocate     max_head_offpolicy_versions   overlaps
        ===================== ======================= ============================= =====================
        None or False         False                   0                             no: the gate admits no
                                                                                    rollout until the push
        None or False         False                   >= 1                          yes
        True                  either                  any                           no: drained each step
        None                  True                    any                           no: the engine sleeps
        False                 True                    any                           ``ConfigError``
        ===================== ======================= ============================= =====================
        """
        return not self.trains_synchronously and self.max_head_offpolicy_versions > 0

    @property
    def error_check_min_attempts(self) -> int:
        """Attempts a step needs before ``max_rollout_error_fraction`` is checked (see the constant)."""
        return max(ERROR_CHECK_MIN_ATTEMPTS, 2 * self.completions_per_prompt)

    @property
    def stall_timeout_s(self) -> float:
        """Seconds without any finished rollout after which a waiting trainer stops the run."""
        return self.rollout_timeout_s + STALL_GRACE_S

    def to_dict(self) -> dict:
        """A JSON-able view (callables by name, each alias only under its nested name) for logs and wandb."""
        d = asdict(self)
        for alias in self.CLI_ALIASES:
            del d[alias]
        d["dynamic_filter_fn"] = getattr(self.dynamic_filter_fn, "__name__", None)
        d["reward_fn"] = getattr(self.reward_fn, "__name__", None)
        if self.group_reward_fn is not None:
            d["group_reward_fn"] = getattr(self.group_reward_fn, "__name__", type(self.group_reward_fn).__name__)
        if callable(self.loss.policy_loss):
            d["loss"]["policy_loss"] = getattr(self.loss.policy_loss, "__name__", "custom")
        # settings added after runs were recorded are left out at their defaults, so such a run still resumes
        for record, defaults in ((d, TOP_RECORDED_WHEN_SET), (d["loss"], RECORDED_WHEN_SET)):
            for name, default in defaults.items():
                if name in record and record[name] == default:
                    del record[name]
        return d


def _show(value: Any) -> str:
    """A setting's value in an error message (a callable by name)."""
    return getattr(value, "__name__", None) or repr(value) if callable(value) else repr(value)


def _given(policy_loss):
    """A ``policy_loss`` value as an explicit one (a plain ``str``, so ``policy_loss_given`` holds for ``"grpo"``)."""
    return str.__str__(policy_loss) if isinstance(policy_loss, str) else policy_loss
