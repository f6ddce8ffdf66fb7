"""Single turn, token in / token out: the prompt is token ids, the completion is token ids.

Task: "Repeat the digit 7. Answer:" -> the first thing the model writes should be 7.
Reward: 1.0 for the right digit, 0.2 for any other digit (a foothold for a random-init
model), 0.0 otherwise.
"""

from training.examples.rl.vanilla_sampler import build_deployment_sampler
from training.utils.rl.rollout import RolloutSample, RolloutSetup


def reward(text: str, answer: str) -> float:
    text = text.strip()
    if text.startswith(answer):
        return 1.0
    return 0.2 if text[:1].isdigit() else 0.0


def make_rollout_fn(setup: RolloutSetup):
    sampler = build_deployment_sampler(setup)

    async def rollout_fn(row: dict) -> RolloutSample:
        (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
        num_out = len(c.full_tokens) - c.prompt_len
        return RolloutSample(
            tokens=c.full_tokens,  # exactly the ids the server saw and generated
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * num_out,
            reward=reward(c.text, row["answer"]),
            finish_reason=c.finish_reason,
            text=c.text,
            token_weight_versions=c.token_weight_versions,  # per generated token (in-flight updates mix versions)
        )

    return rollout_fn
