"""The built-in rollout: what ``main(cfg)`` runs when it is given no ``rollout_fn_factory``.

One completion per call, single turn, GRPO-style (the recipe groups ``completions_per_prompt``
of them per row). The prompt comes from the row:

- ``messages`` (OpenAI chat messages): sampled through ``/v1/chat/completions``, so the server
  applies the model's chat template;
- else ``prompt_token_ids`` (or ``prompt_ids``): sampled token-in/token-out;
- else ``prompt`` (a string): tokenized once with the run's tokenizer (the prompt only; the
  completion's ids are the server's), then sampled token-in/token-out.

The reward is ``cfg.reward_fn(completion_text, row)`` (sync or async), by default
``exact_match_reward``: 1.0 when the completion, stripped, equals the row's ``answer``.
A completion with no generated token is dropped (``None``).
"""

from __future__ import annotations

import inspect
from typing import Any, Awaitable, Callable, Optional, Union

from training.utils.rl.rollout import RolloutFn, RolloutSample, RolloutSetup

RewardFn = Callable[[str, dict], Union[float, Awaitable[float]]]

ANSWER_FIELD = "answer"
"""The row field ``exact_match_reward`` compares against."""


def exact_match_reward(completion: str, row: dict) -> float:
    """1.0 if ``completion.strip() == str(row["answer"]).strip()``, else 0.0 (also when the row has no answer)."""
    answer = row.get(ANSWER_FIELD)
    return float(answer is not None and completion.strip() == str(answer).strip())


def make_single_turn_rollout_fn(reward_fn: Optional[RewardFn] = None) -> Callable[[RolloutSetup], RolloutFn]:
    """A ``make_rollout_fn`` for the built-in rollout, scoring with ``reward_fn`` (default ``exact_match_reward``)."""
    score = reward_fn or exact_match_reward

    def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

        async def rollout_fn(row: dict) -> Optional[RolloutSample]:
            if row.get("messages"):
                (c,) = await sampler.chat(list(row["messages"]), n=1)
            else:
                (c,) = await sampler.sample_with_prompt_tokens(prompt_token_ids(row, setup.tokenizer), n=1)
            num_out = len(c.full_tokens) - c.prompt_len
            if num_out == 0:
                return None
            reward = score(c.text, row)
            if inspect.isawaitable(reward):
                reward = await reward
            return RolloutSample(
                tokens=list(c.full_tokens),
                logprobs=[0.0] * c.prompt_len + list(c.inference_logprobs),
                loss_mask=[0] * c.prompt_len + [1] * num_out,
                reward=float(reward),
                finish_reason=c.finish_reason,
                text=c.text,
            )

        return rollout_fn

    return make_rollout_fn


def prompt_token_ids(row: dict, tokenizer: Any) -> list[int]:
    """The row's prompt as token ids: ``prompt_token_ids`` / ``prompt_ids``, else ``prompt`` tokenized."""
    ids = row.get("prompt_token_ids") or row.get("prompt_ids")
    if ids:
        return list(ids)
    if isinstance(row.get("prompt"), str) and row["prompt"]:
        return list(tokenizer(row["prompt"], add_special_tokens=False)["input_ids"])
    raise ValueError(
        f"row: the built-in rollout needs 'messages', 'prompt_token_ids' or 'prompt'; this row has {sorted(row)}"
    )
