"""A reasoning-gym task through ``training.envs``: the library's questions, its own scorer.

``chain_sum`` with small settings (two or three one-digit terms, + and -), chosen by measurement
among five arithmetic tasks (README.md). The prompt is the model's chat template over a system
prompt and the question; the reply's last integer is scored by ``dataset.score_answer``,
reasoning-gym's own score (SmolLM2-135M rarely writes ``<answer>`` tags, so the tag extractor would
score almost every reply 0). ``make_data.py`` writes ``data.jsonl`` / ``eval.jsonl`` from the same
settings (different seeds).
"""

from training.envs import last_number_answer_fn, make_reasoning_gym_rollout_fn, reasoning_gym_dataset

TASK = "chain_sum"
SETTINGS = dict(min_terms=2, max_terms=3, min_digits=1, max_digits=1)
"""The dataset's settings (``reasoning_gym.create_dataset(TASK, **SETTINGS)``)."""
SYSTEM_PROMPT = "Compute the result. End your reply with 'Answer: <number>'."


def dataset(size: int = 1, seed: int = 0):
    """The library's dataset with the example's settings (scoring uses only an entry, not the seed)."""
    return reasoning_gym_dataset(TASK, size=size, seed=seed, **SETTINGS)


make_rollout_fn = make_reasoning_gym_rollout_fn(dataset(), answer_fn=last_number_answer_fn)
