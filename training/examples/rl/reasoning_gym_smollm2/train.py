"""RL on a reasoning-gym task (``chain_sum``) with SmolLM2-135M-Instruct, offline on CPU.

``python train.py [key=value ...]`` (``--help`` lists keys); ``base_model=tiny`` checks the plumbing.
Evaluates on the held-out problems (``eval.jsonl``) before and after training.
"""

from pathlib import Path

from training.recipes.config import Config
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.cli import apply_overrides

HERE = Path(__file__).parent

cfg = Config(
    base_model="smollm2",
    log_path="runs/reasoning_gym_smollm2",
    completions_per_prompt=8,
    prompt_groups_per_step=4,
    max_head_offpolicy_versions=1,
    max_tokens=32,
    temperature=0.7,
    max_steps=16,
    eval_rows=str(HERE / "eval.jsonl"),
    eval_interval=8,
    trainer=TrainerConfig(learning_rate=1e-5, micro_batch_tokens=1024),
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
    deployment=DeployConfig(engine_config=EngineConfig(max_model_len=512)),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    from rollout import make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=HERE / "data.jsonl")
