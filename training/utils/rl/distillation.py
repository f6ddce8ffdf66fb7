"""On-policy distillation: the teacher's per-token reward and the advantage the student trains with.

The student samples y ~ π_s(·|x) (the recipe's normal rollouts). A teacher scores the same token ids
(log π_t(y_t | x, y_<t): a prompt-logprobs forward over the student's own sequence, nothing generated).
On every trainable token (``loss_mask`` 1)

    r_t = log π_t(y_t) − log π_s(y_t)            minus the reverse KL's one-sample estimate
    A_t = kl_coef · r_t + task_reward_coef · Â_t

and A_t = 0 on the other tokens. log π_s is the sampler's logprob (``RolloutSample.logprobs``: the
distribution that drew the token, at the run's ``temperature``); Â_t is the sample's task advantage
(its group-normalised reward, or its own ``token_advantages``). With ``task_reward_coef = 0`` (the
default) the task reward trains nothing and the run is pure distillation: the expected A_t is
−kl_coef·KL(π_s ‖ π_t) at that prefix, so the policy gradient pushes the student toward the teacher on the
states the student itself visits (mode-seeking, dense: one signal per token rather than one per sequence).

Why this shape (the choices tinker-cookbook's ``distillation`` recipe makes too): the reward is taken per
token and not summed over the future (no discount: each token is credited only with its own log-ratio);
the teacher sees exactly the student's token ids (one tokenizer); the teacher is scored at the
temperature T the student sampled at (``training/recipes/teacher.py``), so both logprobs are of
softmax(logits / T) and the estimate is KL(π_s^T ‖ π_t^T): 0 on every token when the teacher is the
student. At T = 1 that is the student itself against the raw teacher.
Which loss: ``importance_sampling`` (Config's default when distillation is on and the loss is left at
its defaults): −r·A·w, the unclipped policy gradient with the train/inference correction w; clipping is
inert with one update per step anyway, and a reference-model KL would pull toward the starting student,
which the teacher term already does better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from training.utils.config import ConfigError, DeployConfig, EngineConfig


def _teacher_deployment() -> DeployConfig:
    return DeployConfig(engine_config=EngineConfig(max_batch_size=1))


@dataclass
class DistillationConfig:
    """On-policy distillation from a teacher (off unless ``teacher_model`` or ``deployment.base_url`` is set).

    The recipe starts the teacher's deployment beside the student's, asks it for the logprob of every token of
    each trained sample before the training step, and trains on A_t = kl_coef·(log π_t − log π_s) +
    task_reward_coef·Â (``training/utils/rl/distillation.py``; skill: ``skills/on-policy-distillation``)."""

    teacher_model: Optional[str] = None
    """The teacher: a folder (e.g. the ``final`` export of an RL run), a hub id, or a short name (``smollm2``,
    ``tiny``), served by a second embedded server; it must use the student's tokenizer. None with
    ``deployment.base_url`` set: the teacher is that running server."""
    deployment: DeployConfig = field(default_factory=_teacher_deployment)
    """How the teacher is served: embedded (launched, the default; ``max_batch_size=1``, since a scoring request
    keeps no KV cache), or ``base_url`` of a running server (``engine="vllm"`` for vLLM: it answers
    ``prompt_logprobs`` and needs ``max_tokens >= 1``, so one token is generated and dropped per request)."""
    kl_coef: float = 1.0
    """Weight of the per-token reward log π_t − log π_s in the advantage."""
    task_reward_coef: float = 0.0
    """Weight of the task advantage (the group-normalised ``reward``) added to every trainable token; 0 = pure
    distillation (the rollouts' rewards are then only logged)."""

    def __post_init__(self):
        if self.teacher_model is not None and (not isinstance(self.teacher_model, str) or not self.teacher_model):
            raise ConfigError(
                f"distillation.teacher_model: must be a folder, hub id or short name, got {self.teacher_model!r}"
            )
        if not isinstance(self.deployment, DeployConfig):
            raise ConfigError("distillation.deployment: must be a DeployConfig")
        for name in ("kl_coef", "task_reward_coef"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"distillation.{name}: must be a finite number >= 0, got {value!r}")
        if self.enabled and self.kl_coef == 0 and self.task_reward_coef == 0:
            raise ConfigError("distillation.kl_coef: kl_coef and task_reward_coef are both 0: nothing would train")

    @property
    def enabled(self) -> bool:
        """Whether the run distils: a teacher model to launch, or a teacher server to attach to."""
        return self.teacher_model is not None or self.deployment.base_url is not None


def distillation_advantages(
    loss_mask_T: Sequence[int],
    sampler_logprobs_T: Sequence[float],
    teacher_logprobs_T: Sequence[Optional[float]],
    task_advantage: Union[float, Sequence[float]],
    kl_coef: float,
    task_reward_coef: float,
) -> list[float]:
    """A_t of one sample (module docstring): kl_coef·(teacher − sampler) + task_reward_coef·Â on trainable tokens, 0
    elsewhere. ``task_advantage``: the sample's scalar advantage or its per-token list. Raises ``ValueError`` naming
    the argument when the lists are not parallel or a trainable token has no finite teacher logprob."""
    n = len(loss_mask_T)
    if len(sampler_logprobs_T) != n or len(teacher_logprobs_T) != n:
        raise ValueError(
            f"teacher_logprobs_T: {len(teacher_logprobs_T)} teacher and {len(sampler_logprobs_T)} sampler logprobs "
            f"for {n} tokens"
        )
    task_T = task_advantage if isinstance(task_advantage, (list, tuple)) else [float(task_advantage)] * n
    if len(task_T) != n:
        raise ValueError(f"task_advantage: {len(task_T)} values for {n} tokens")
    out = []
    for t, (m, s, teacher, task) in enumerate(zip(loss_mask_T, sampler_logprobs_T, teacher_logprobs_T, task_T)):
        if not m:
            out.append(0.0)
            continue
        if teacher is None or not math.isfinite(teacher):
            raise ValueError(f"teacher_logprobs_T[{t}]: {teacher!r} is not a finite logprob of a trainable token")
        out.append(kl_coef * (teacher - s) + task_reward_coef * task)
    return out


@dataclass
class DistillationStats:
    """Sums over a step's trainable tokens, for the ``distill/*`` metrics."""

    tokens: int = 0
    samples: int = 0
    reverse_kl_sum: float = 0.0
    teacher_logprob_sum: float = 0.0
    sampler_logprob_sum: float = 0.0
    advantage_sum: float = 0.0

    def add(self, loss_mask_T, sampler_logprobs_T, teacher_logprobs_T, advantages_T) -> None:
        """Add one sample (its lists as ``distillation_advantages`` took and returned them)."""
        self.samples += 1
        for m, s, teacher, a in zip(loss_mask_T, sampler_logprobs_T, teacher_logprobs_T, advantages_T):
            if m:
                self.tokens += 1
                self.reverse_kl_sum += s - teacher
                self.teacher_logprob_sum += teacher
                self.sampler_logprob_sum += s
                self.advantage_sum += a

    def metrics(self) -> dict[str, float]:
        """``distill/reverse_kl`` (mean over trainable tokens of log π_s − log π_t), ``distill/reverse_kl_per_sample``
        (its sum per sample, averaged), ``distill/teacher_logprob_mean``, ``distill/student_logprob_mean`` (the
        sampler's), ``distill/advantage_mean``, ``distill/scored_tokens``."""
        tokens = max(self.tokens, 1)
        return {
            "distill/reverse_kl": self.reverse_kl_sum / tokens,
            "distill/reverse_kl_per_sample": self.reverse_kl_sum / max(self.samples, 1),
            "distill/teacher_logprob_mean": self.teacher_logprob_sum / tokens,
            "distill/student_logprob_mean": self.sampler_logprob_sum / tokens,
            "distill/advantage_mean": self.advantage_sum / tokens,
            "distill/scored_tokens": float(self.tokens),
        }
