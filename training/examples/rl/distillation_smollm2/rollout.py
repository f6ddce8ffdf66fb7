"""The arithmetic word problems of ``../arithmetic_smollm2``, for the student of on-policy distillation.

The rollout is an ordinary one: the chat template applied to one user message, one sampled reply with its
exact token ids and logprobs. Its reward (1.0 when the last integer in the reply is the answer) trains
nothing here unless ``distillation.task_reward_coef > 0``: the recipe's teacher scores every generated
token and the student trains on that per-token reward. The reward still drives ``rollout/reward_mean``
and the held-out eval.
"""

import re

from training.examples.rl.vanilla_sampler import build_deployment_sampler
from training.utils.rl.rollout import RolloutSample, RolloutSetup

INSTRUCTION = "Solve the problem. End your reply with 'Answer: <number>'."
"""The arithmetic example's instruction: the teacher was trained on exactly these prompts."""


def final_number(text: str) -> str | None:
    numbers = re.findall(r"-?\d+", text.replace(",", ""))
    return numbers[-1] if numbers else None


def make_rollout_fn(setup: RolloutSetup):
    sampler = build_deployment_sampler(setup)
    tokenizer = setup.tokenizer

    async def rollout_fn(row: dict) -> RolloutSample:
        messages = [{"role": "user", "content": f"{row['question']}\n{INSTRUCTION}"}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        (c,) = await sampler.sample_with_prompt_tokens(prompt, n=1)
        num_out = len(c.full_tokens) - c.prompt_len
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * num_out,
            reward=1.0 if final_number(c.text) == row["answer"] else 0.0,
            finish_reason=c.finish_reason,
            text=c.text,
            token_weight_versions=c.token_weight_versions,
        )

    return rollout_fn
