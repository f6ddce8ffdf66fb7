"""A short answer that follows one instruction, through the model's own chat template.

The prompt is the chat template applied to one user message (the row's ``prompt``: a question and an
instruction). The rollout returns the held-out verifier's verdict (``constraints.follows``: 1.0 or 0.0) as its
``reward`` and as the component ``verifier``. That reward is what the eval scores; in training the judge
(``train.py``'s ``group_reward_fn``) replaces it with its own, so the policy never learns from the verifier,
which is only logged (``rollout/reward/verifier_mean``).
"""

from constraints import follows

from training.examples.rl.vanilla_sampler import build_deployment_sampler
from training.utils.rl.rollout import RolloutSample, RolloutSetup


def make_rollout_fn(setup: RolloutSetup):
    sampler = build_deployment_sampler(setup)
    tokenizer = setup.tokenizer

    async def rollout_fn(row: dict) -> RolloutSample:
        messages = [{"role": "user", "content": row["prompt"]}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        (c,) = await sampler.sample_with_prompt_tokens(prompt, n=1)
        num_out = len(c.full_tokens) - c.prompt_len
        verdict = 1.0 if follows(c.text, row["constraint"]) else 0.0
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * num_out,
            reward=verdict,  # the eval's score; a training group's reward is the judge's (train.py)
            reward_components={"verifier": verdict},
            finish_reason=c.finish_reason,
            text=c.text,
            token_weight_versions=c.token_weight_versions,
        )

    return rollout_fn
