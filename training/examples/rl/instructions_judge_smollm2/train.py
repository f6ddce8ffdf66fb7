"""RL from a judge alone: SmolLM2-135M-Instruct learns to follow short instructions, offline on CPU.

``python train.py [key=value ...]`` (``--help`` lists keys); ``base_model=tiny`` checks the plumbing.

Phases: convert the model once (``training.models.smollm2``); launch the judge, a second embedded server on a
frozen copy of the base model, on first use; evaluate the held-out rows (``eval.jsonl``) with the Python verifier
(``constraints.py``); train on the judge's group-relative rewards (``training.rewards.GroupJudge``: one request per
group, its answer constrained to a JSON schema of scores); evaluate again.
"""

from dataclasses import replace
from pathlib import Path

from training.recipes.config import Config
from training.rewards import GroupJudge, JudgeConfig
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.cli import apply_overrides
from training.utils.rl.filters import has_learning_signal

HERE = Path(__file__).parent

RUBRIC = (
    "The task ends with one instruction (write in lower case only, stay under a word limit, use a given word, or "
    "use no commas). A response that breaks that instruction must score low, however good it is otherwise; "
    "among the responses that follow it, a short, clear answer to the question scores highest."
)


def judge_for(model: str) -> GroupJudge:
    """The judge: ``model`` served on its own embedded server (one thread, 127.0.0.1), its answer constrained to the
    JSON schema of scores. Sampled at temperature 1 (the request seed comes from the request's content): greedy,
    SmolLM2-135M gives every member of most groups the same score, and such a group carries no advantage."""
    server = DeployConfig(engine_config=EngineConfig(max_model_len=1024, num_threads=1, kv_cache_memory_bytes=2**27))
    judge = JudgeConfig(
        model=model, deployment=server, temperature=1.0, max_tokens=160, reason_max_chars=24, max_concurrency=4
    )
    return GroupJudge(judge, rubric=RUBRIC)


cfg = Config(
    base_model="smollm2",
    log_path="runs/instructions_judge_smollm2",
    completions_per_prompt=4,
    prompt_groups_per_step=4,
    max_head_offpolicy_versions=1,
    max_tokens=40,
    temperature=0.8,
    max_steps=12,
    eval_rows=str(HERE / "eval.jsonl"),
    eval_interval=6,
    group_reward_fn=judge_for("smollm2"),  # the only training reward (rollout.py's verifier is replaced)
    dynamic_filter_fn=has_learning_signal,  # a group the judge scored all equal carries no advantage
    trainer=TrainerConfig(learning_rate=2e-5, micro_batch_tokens=1024),
    loss=LossConfig(policy_loss="grpo", kl_beta=0.0),
    deployment=DeployConfig(engine_config=EngineConfig(max_model_len=512, kv_cache_memory_bytes=2**28)),
)

if __name__ == "__main__":
    cfg = apply_overrides(cfg)  # first: --help and a mistyped key answer at once, before torch loads
    cfg = replace(cfg, group_reward_fn=judge_for(cfg.base_model))  # the judge is the run's base model, frozen
    from rollout import make_rollout_fn
    from training.recipes.async_rl_loop import main

    main(cfg, rollout_fn_factory=make_rollout_fn, rows=HERE / "data.jsonl")
