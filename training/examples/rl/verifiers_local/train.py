"""Train on a verifiers environment built from local data: ``python train.py [key=value ...]``.

Needs verifiers 0.2.x (``pip install -e ".[verifiers]"``). ``base_model=smollm2`` trains
SmolLM2-135M-Instruct instead of the tiny model.
"""

from training.recipes.config import Config
from training.utils import LossConfig, TrainerConfig
from training.utils.cli import apply_overrides

cfg = Config(
    base_model="tiny",
    log_path="runs/verifiers_local",
    completions_per_prompt=4,
    prompt_groups_per_step=4,
    max_head_offpolicy_versions=1,
    max_tokens=12,
    max_steps=20,
    trainer=TrainerConfig(learning_rate=1e-3),
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    try:
        from rollout import ROWS, make_rollout_fn
    except ModuleNotFoundError as e:  # the one extra this example needs, in one line
        if e.name != "verifiers":
            raise
        raise SystemExit(
            'verifiers_local needs verifiers, not installed by scripts/setup.sh: pip install -e ".[verifiers]"'
        ) from None
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
