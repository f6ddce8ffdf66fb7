"""Environments users already have, as rollouts: reasoning-gym datasets, verifiers environments and
gym-style text environments, each turned into a ``make_rollout_fn(setup)`` (see README.md).

The libraries are optional (``pip install -e ".[envs]"``; verifiers: ``".[verifiers]"``); each module imports its library when
it is used, so ``import training.envs`` works without them."""

from training.envs.reasoning_gym_env import (
    last_number_answer_fn,
    make_reasoning_gym_rollout_fn,
    reasoning_gym_dataset,
    reasoning_gym_rows,
    reasoning_gym_scorer,
)
from training.envs.text_gym import TextGymEnvironment, make_text_gym_rollout_fn
from training.envs.verifiers_env import VerifiersEnvironment, make_verifiers_rollout_fn, verifiers_rows

__all__ = [
    "last_number_answer_fn",
    "make_reasoning_gym_rollout_fn",
    "reasoning_gym_dataset",
    "reasoning_gym_rows",
    "reasoning_gym_scorer",
    "TextGymEnvironment",
    "make_text_gym_rollout_fn",
    "VerifiersEnvironment",
    "make_verifiers_rollout_fn",
    "verifiers_rows",
]
