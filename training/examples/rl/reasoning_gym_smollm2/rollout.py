"""A reasoning-gym task through ``training.envs``: the library's questions, its own scorer.

``basic_arithmetic`` with small settings (two one-digit terms, + and -). The prompt is the
model's chat template over a system prompt and the question; the reply is scored by
``dataset.score_answer(<text inside <answer>...</answer>>, entry)``, reasoning-gym's own score.
``make_data.py`` writes ``data.jsonl`` / ``eval.jsonl`` from the same settings (different seeds).
"""

from training.envs import make_reasoning_gym_rollout_fn, reasoning_gym_dataset

TASK = "basic_arithmetic"
SETTINGS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"), allow_negation=False)
"""The dataset's settings (``reasoning_gym.create_dataset(TASK, **SETTINGS)``)."""
SYSTEM_PROMPT = "Compute the result. Reply with the number only, inside answer tags, e.g. <answer>7</answer>."


def dataset(size: int = 1, seed: int = 0):
    """The library's dataset with the example's settings (scoring uses only an entry, not the seed)."""
    return reasoning_gym_dataset(TASK, size=size, seed=seed, **SETTINGS)


make_rollout_fn = make_reasoning_gym_rollout_fn(dataset())
