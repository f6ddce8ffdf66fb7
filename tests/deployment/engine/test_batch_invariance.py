"""With prefix caching off, a seeded request's tokens and logprobs are bit for bit the same whatever runs beside it.

This is what makes a resumed run equal an uninterrupted one after a server restart
(``tests/recipes/test_resume_seeds.py``): the sampler logprobs enter the loss (the TIS weight), and the
requests of a step arrive in a timing-dependent order. With prefix caching on, a prompt computed in
part from another request's cached K/V (one token prefilled where a cold engine prefills all of
them) or decoded in a shared-prefix attention segment with its group (summed in another order)
differs in the last bits (engine/README.md, "Batch invariance").
"""

from __future__ import annotations

import asyncio
import random

import pytest

from training.deployment.engine import SamplingParams
from tests.deployment.engine.test_engine import require_native, run_engine

MAX_TOKENS = 12


def seeded(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("kernel", ["native", "torch"])
def test_seeded_request_is_bit_identical_alone_in_a_batch_and_in_its_group(tiny_model_path, kernel):
    if kernel == "native":
        require_native()
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(40)]
    others = [[rng.randrange(3, 500) for _ in range(rng.randrange(5, 60))] for _ in range(7)]
    target = (prompt, seeded(1))

    async def after_first_token(eng, started: list[tuple[list[int], SamplingParams]]):
        """``target`` submitted once ``started`` are all decoding (it joins a running batch in a later step)."""
        streams = [eng.generate_stream(p, sp) for p, sp in started]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await asyncio.gather(*firsts)
        rest = [asyncio.ensure_future(_drain(s)) for s in streams]
        result = await eng.generate(*target)
        await asyncio.gather(*rest)
        return result

    async def body(eng):
        runs = {"alone": await eng.generate(*target)}
        together = await asyncio.gather(
            eng.generate(*target), *(eng.generate(p, seeded(10 + i)) for i, p in enumerate(others))
        )
        runs["with 7 other prompts"] = together[0]
        group = await asyncio.gather(eng.generate(*target), *(eng.generate(prompt, seeded(20 + i)) for i in range(7)))
        runs["in its group of 8"] = group[0]
        runs["joining its running group"] = await after_first_token(eng, [(prompt, seeded(30 + i)) for i in range(7)])
        runs["joining 7 running prompts"] = await after_first_token(
            eng, [(p, seeded(40 + i)) for i, p in enumerate(others)]
        )
        return runs

    runs = run_engine(tiny_model_path, body, enable_prefix_caching=False, decode_kernel=kernel, max_batch_size=16)
    alone = runs.pop("alone")
    assert len(alone.output_token_ids) == MAX_TOKENS
    for name, result in runs.items():
        assert result.output_token_ids == alone.output_token_ids, name
        assert result.output_logprobs == alone.output_logprobs, name  # exact, not approximately


async def _drain(stream) -> None:
    async for _ in stream:
        pass
