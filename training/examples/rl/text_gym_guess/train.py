"""Train on the guessing game: ``python train.py [key=value ...]`` (``--help`` lists keys).

``base_model=smollm2`` trains SmolLM2-135M-Instruct instead of the tiny model.
"""

from pathlib import Path

from training.recipes.config import Config
from training.utils import LossConfig, TrainerConfig
from training.utils.cli import apply_overrides

HERE = Path(__file__).parent

cfg = Config(
    base_model="tiny",
    log_path="runs/text_gym_guess",
    completions_per_prompt=4,
    prompt_groups_per_step=4,
    max_head_offpolicy_versions=1,
    max_tokens=8,
    max_steps=20,
    trainer=TrainerConfig(learning_rate=1e-3),
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    from rollout import HIGH, make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=[{"target": t} for t in range(1, HIGH + 1)])
