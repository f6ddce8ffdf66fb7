"""Multi turn, messages in: the model answers; when it is wrong it is told so and retries.

The conversation is built token by token: each turn's prompt is the previous prompt plus
the tokens the model generated plus the rendered feedback message, so the whole episode is
one sequence whose ``loss_mask`` is 1 exactly on the tokens the server generated. Nothing the
model wrote is ever re-tokenized. The reward of the episode is 1.0 for a right answer on the
first try, discounted by ``RETRY_DISCOUNT`` per retry, 0.0 if every try was wrong.
"""

import uuid

from reward import score

from training.examples.rl.vanilla_sampler import build_deployment_sampler
from training.utils.rl.rollout import RolloutSample, RolloutSetup

MAX_TURNS = 3
RETRY_DISCOUNT = 0.5
FEEDBACK = "That is not right. Try again; reply with the number only."
STUB = "<<assistant reply>>"


def make_rollout_fn(setup: RolloutSetup):
    sampler = build_deployment_sampler(setup)
    tokenizer = setup.tokenizer

    def render_user_turn(content: str) -> list[int]:
        """Template tokens from the end of an assistant reply to the start of the next one.

        Taken from the model's own chat template: everything it renders after a stub
        assistant reply (end of turn, the user turn with ``content``, the next assistant header).
        """
        stub = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": STUB},
            {"role": "user", "content": content},
        ]
        text = tokenizer.apply_chat_template(stub, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text[text.rindex(STUB) + len(STUB) :], add_special_tokens=False)

    async def rollout_fn(row: dict) -> RolloutSample:
        tokens = tokenizer.apply_chat_template(
            row["messages"], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        logprobs = [0.0] * len(tokens)
        loss_mask = [0] * len(tokens)
        versions = []  # weight version of each generated token, in order
        session = uuid.uuid4().hex  # lets the server reuse this episode's KV cache between turns
        reward = 0.0
        for turn in range(MAX_TURNS):
            (c,) = await sampler.sample_with_prompt_tokens(tokens, n=1, session_id=session)
            output = c.full_tokens[c.prompt_len :]
            tokens = tokens + output
            logprobs += c.inference_logprobs
            loss_mask += [1] * len(output)
            versions += c.token_weight_versions or [c.weight_version] * len(output)
            if score(c.text, row["answer"]) > 0:
                reward = RETRY_DISCOUNT**turn
                break
            if c.finish_reason != "stop" or turn == MAX_TURNS - 1:
                break
            # the model ended its turn with the end-of-turn token; the template's glue starts
            # with the same token: keep the generated one, append the rest as context (mask 0)
            glue = render_user_turn(FEEDBACK)
            if output and glue and glue[0] == output[-1]:
                glue = glue[1:]
            tokens += glue
            logprobs += [0.0] * len(glue)
            loss_mask += [0] * len(glue)
        return RolloutSample(
            tokens=tokens,
            logprobs=logprobs,
            loss_mask=loss_mask,
            reward=reward,
            finish_reason=c.finish_reason,
            text=c.text,
            token_weight_versions=versions,
        )

    return rollout_fn
