"""Train SmolLM2-135M-Instruct to use a calculator tool: ``python train.py [key=value ...]``.

The command line is read only when run as a script; importing this file builds nothing.
``base_model=tiny`` runs the same pipeline on the tiny random model (a smoke run).
"""

from pathlib import Path

from training.recipes.config import Config
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.cli import apply_overrides

HERE = Path(__file__).parent

cfg = Config(
    base_model="smollm2",
    log_path="runs/tool_use_smollm2",
    completions_per_prompt=4,
    prompt_groups_per_step=2,
    max_head_offpolicy_versions=1,
    max_tokens=40,
    temperature=1.0,
    max_steps=6,
    eval_rows=str(HERE / "eval.jsonl"),
    eval_interval=6,
    dcp_save_interval=3,  # Ctrl-C, then the same command again, resumes here
    trainer=TrainerConfig(learning_rate=5e-5, micro_batch_tokens=1024),  # ~1.5 GB of activations on CPU
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
    # an episode is at most 512 tokens (rollout.MAX_TOTAL_TOKENS); 16 slots x 512 keep the KV cache small
    deployment=DeployConfig(engine_config=EngineConfig(max_model_len=512, max_batch_size=16)),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    from rollout import make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=HERE / "data.jsonl")
