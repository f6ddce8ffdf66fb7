"""``Teacher``: the distillation teacher of a run (``Config.distillation``): its deployment and the scoring of a step.

``start_teacher(cfg, log_path, student_tokenizer, threads)`` launches the teacher's server (a second embedded
server by default, its log in ``<log_path>/teacher.log``) or attaches to ``distillation.deployment.base_url``;
``Teacher.distill(groups)``, awaited by the loops before each training step, asks it for the logprob of every
token of every sample of the step (``prompt_logprobs`` requests of up to ``SEQUENCES_PER_REQUEST`` samples of one
group, all at once, at the run's sampling ``temperature``: see below), replaces each
sample's advantage by the per-token one (``training/utils/rl/distillation.py``) and returns the ``distill/*``
metrics. The teacher holds no state of the run: a resumed run starts it again and scores the same way.

The teacher is scored at ``Config.temperature``, the temperature the student's samples were drawn at (their
``logprobs`` are log softmax(logits / T)): the reward log π_t^T − log π_s^T then compares the two at one
temperature, and a teacher equal to the student gives 0 on every token. Scored raw (T = 1) against a student
sampled at T = 0.7 it would pull the student toward a flattened teacher. The embedded server applies the
request's temperature to ``prompt_logprobs``; vLLM's are raw whatever it is, so with vLLM as the teacher and
T ≠ 1 the reward carries that gap (logged as a warning at start).

What ``start_teacher`` decides, once (logged):
- the teacher's ``max_model_len`` is raised to the student's when it is shorter (a launched teacher must take
  every sequence the student can produce; plus one token for a backend that generates one to score
  (``Backend.scores_prompts_alone`` False: vLLM);
- CPU threads, for a backend that reads ``EngineConfig.num_threads`` (the embedded one):
  ``distillation.deployment.engine_config.num_threads`` when set, else ``threads`` (what the recipe gives it: the
  trainer's share, since the trainer waits while the teacher scores);
- a local teacher must have the student's vocabulary (the ids it scores are the student's): checked here.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

from training.deployment.group import DeploymentGroup
from training.models import resolve_model
from training.recipes.config import Config
from training.utils.config import backend
from training.utils.rl.distillation import DistillationStats, distillation_advantages
from training.utils.rl.groups import PromptGroup

logger = logging.getLogger("training.recipe")

SEQUENCES_PER_REQUEST = 16
"""Samples scored in one ``prompt_logprobs`` request (a group's samples, in chunks of at most this many)."""


class Teacher:
    """A started teacher deployment and the scoring of a step's groups."""

    def __init__(self, cfg: Config, group: DeploymentGroup):
        self.distillation = cfg.distillation
        self.group = group
        self.score_only = backend(group.cfg.engine).scores_prompts_alone
        """The backend scores with ``max_tokens: 0`` (nothing generated: the embedded server); else 1 (vLLM)."""
        self.temperature = cfg.temperature
        """The student's sampling temperature, at which the teacher is scored (module docstring)."""

    async def distill(self, groups: list[PromptGroup]) -> dict[str, float]:
        """Score every sample of ``groups`` with the teacher, set their per-token advantages, return ``distill/*``."""
        chunks = [
            [s.tokens for s in g.samples[i : i + SEQUENCES_PER_REQUEST]]
            for g in groups
            for i in range(0, len(g.samples), SEQUENCES_PER_REQUEST)
        ]
        max_tokens = 0 if self.score_only else 1
        answers_flat = iter(
            a
            for chunk in await asyncio.gather(
                *(
                    self.group.sampler.prompt_logprobs(c, max_tokens=max_tokens, temperature=self.temperature)
                    for c in chunks
                )
            )
            for a in chunk
        )
        scored = [[next(answers_flat) for _ in g.samples] for g in groups]
        stats = DistillationStats()
        d = self.distillation
        for g, answers in zip(groups, scored):
            for i, (sample, answer) in enumerate(zip(g.samples, answers)):
                advantages_T = distillation_advantages(
                    sample.loss_mask, sample.logprobs, answer.logprobs, g.advantages[i], d.kl_coef, d.task_reward_coef
                )
                stats.add(sample.loss_mask, sample.logprobs, answer.logprobs, advantages_T)
                g.advantages[i] = advantages_T
        return stats.metrics()

    def stop(self) -> None:
        self.group.stop()

    async def close_sampler(self) -> None:
        if self.group.sampler is not None:
            await self.group.sampler.close()


def _check_vocabulary(teacher_path: str, student_tokenizer: Any) -> None:
    """Refuse a local teacher whose tokenizer maps tokens to other ids than the student's (one line naming it)."""
    from transformers import AutoTokenizer

    try:
        teacher = AutoTokenizer.from_pretrained(teacher_path)
    except (OSError, ValueError) as e:
        raise ValueError(f"distillation.teacher_model: cannot load a tokenizer from {teacher_path!r}: {e}") from None
    if teacher.get_vocab() != student_tokenizer.get_vocab():
        raise ValueError(
            f"distillation.teacher_model: {teacher_path!r} has another vocabulary than the student "
            f"({len(teacher)} vs {len(student_tokenizer)} tokens, or the same tokens with other ids); on-policy "
            "distillation scores the student's own token ids, so the teacher must share its tokenizer"
        )


def start_teacher(cfg: Config, log_path: Path, student_tokenizer: Any, threads: Optional[int]) -> Optional[Teacher]:
    """Launch or attach the teacher of ``cfg.distillation`` (None when distillation is off); see the module docstring."""
    d = cfg.distillation
    if not d.enabled:
        return None
    dcfg = d.deployment
    model_path = ""
    if d.teacher_model is not None:
        model_path = resolve_model(d.teacher_model)
        _check_vocabulary(model_path, student_tokenizer)
    engine, facts = dcfg.engine_config, backend(dcfg.engine)
    if dcfg.base_url is None:
        need = cfg.deployment.engine_config.max_model_len + (0 if facts.scores_prompts_alone else 1)
        if engine.max_model_len < need:
            logger.info("teacher: max_model_len %d -> %d (the student's sequences)", engine.max_model_len, need)
            engine = replace(engine, max_model_len=need)
        if engine.num_threads is None and threads is not None and facts.reads("num_threads"):
            engine = replace(engine, num_threads=threads)
        if engine.seed is None:
            engine = replace(engine, seed=cfg.seed)
        dcfg = replace(dcfg, engine_config=engine, log_file=dcfg.log_file or str(log_path / "teacher.log"))
    where = dcfg.base_url or f"{dcfg.engine} server, log {dcfg.log_file}"
    logger.info(
        "teacher: %s (%s); kl_coef %g, task_reward_coef %g", d.teacher_model, where, d.kl_coef, d.task_reward_coef
    )
    if cfg.temperature != 1.0 and not facts.scores_prompts_alone:
        logger.warning(
            "teacher: the %s backend returns raw prompt logprobs (temperature 1) while the student samples at "
            "temperature %g: the distillation reward compares the two at different temperatures",
            dcfg.engine,
            cfg.temperature,
        )
    group = DeploymentGroup(model_path, dcfg, trainer=cfg.trainer).start()
    return Teacher(cfg, group)
