"""Train the single-turn token-in example: ``python train.py [key=value ...]`` (``--help`` lists keys).

Defaults run on CPU in a few minutes on the tiny offline model; ``base_model=smollm2`` or any
hub id / folder trains a real model instead.
"""

import dataclasses
from pathlib import Path

from training.recipes.config import Config
from training.utils import LossConfig, TrainerConfig
from training.utils.cli import apply_overrides
from training.utils.data import load_rows

HERE = Path(__file__).parent

cfg = Config(
    base_model="tiny",
    log_path="runs/single_turn_token_in",
    completions_per_prompt=8,
    prompt_groups_per_step=8,
    max_head_offpolicy_versions=1,
    max_tokens=4,
    max_steps=120,
    epochs=4,
    eval_interval=30,
    dcp_save_interval=10,  # Ctrl-C, then the same command again, resumes here
    trainer=TrainerConfig(learning_rate=5e-3),
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
)


def pretokenize(path: Path, tokenizer) -> list[dict]:
    """The rows of ``path`` with ``prompt_ids``: the rollout sends ids and trains on the ids it gets back."""
    return [dict(r, prompt_ids=tokenizer.encode(r["prompt"])) for r in load_rows(path)]


if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    from transformers import AutoTokenizer

    from rollout import make_rollout_fn
    from training.models import resolve_model
    from training.recipes.async_rl_loop import main
    from training.recipes.resources import check_run_inputs

    check_run_inputs(cfg)  # a base_model typo or a missing data file: one line, before the tokenizer loads
    tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg.base_model))
    cfg = dataclasses.replace(cfg, eval_rows=cfg.eval_rows or pretokenize(HERE / "eval.jsonl", tokenizer))
    main(cfg, rollout_fn_factory=make_rollout_fn, rows=pretokenize(HERE / "data.jsonl", tokenizer))
