"""A gym-style text environment through ``training.envs.text_gym``: multi-turn, token-in/token-out.

Each row names a target (``{"target": 7}``); the game says "higher" / "lower" after each guess and
pays 1.0 for the right one. The whole conversation is one sample: ``loss_mask`` is 1 only on the
model's replies, every prompt extends the previous tokens (``training.agents.TrajectoryEngine``).
"""

from guess_env import GuessNumber

from training.envs import make_text_gym_rollout_fn

HIGH = 10
MAX_STEPS = 4
"""Guesses per episode; an episode without the right one ends with stop reason ``max_steps``."""
SYSTEM_PROMPT = "Play the guessing game. Each reply is one number."

make_rollout_fn = make_text_gym_rollout_fn(
    lambda row: GuessNumber(int(row["target"]), HIGH), system_prompt=SYSTEM_PROMPT, max_steps=MAX_STEPS
)
