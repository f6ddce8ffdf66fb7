"""The local verifiers environment through ``training.envs.verifiers_env``: its prompts, its
``env_response`` and its rubric; our sampler (exact tokens, ``loss_mask`` on the model's turns).
"""

from environment import load_environment

from training.envs import make_verifiers_rollout_fn, verifiers_rows

ENV = load_environment()
ROWS = verifiers_rows(ENV)
"""The environment's formatted dataset (``prompt``, ``answer``, ``example_id``...)."""

make_rollout_fn = make_verifiers_rollout_fn(ENV)
