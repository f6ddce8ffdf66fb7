"""The engine thread's inbox (inbox.py): what it takes when, on a real engine over the tiny model."""

from __future__ import annotations

import asyncio

from tests.deployment.engine.test_engine import PROMPTS, _perturbed, greedy, run_engine


async def _finished(order: list[str], name: str, awaitable):
    result = await awaitable
    order.append(name)
    return result


def test_a_sleep_waits_for_running_work_and_holds_what_comes_after_it_until_the_wake(tiny_model_path):
    """A sleep goes once nothing runs: a running request finishes before the sleep answers; requests and scoring
    posted behind the sleep are held (not run, not lost) until the wake, then run."""

    async def body(eng):
        order: list[str] = []
        before = asyncio.create_task(_finished(order, "before", eng.generate(PROMPTS[2], greedy(200))))
        for _ in range(3000):  # until the engine thread runs it (a request still in the inbox is held by a sleep)
            if eng.stats()["running"]:
                break
            await asyncio.sleep(0.01)
        sleep = asyncio.create_task(_finished(order, "sleep", eng.sleep(1)))
        await asyncio.sleep(0)
        after = asyncio.create_task(_finished(order, "after", eng.generate(PROMPTS[0], greedy(5))))
        scored = asyncio.create_task(_finished(order, "scored", eng.prompt_logprobs([PROMPTS[1]])))
        await asyncio.wait_for(sleep, 60)
        await asyncio.sleep(0.5)
        held = (after.done(), scored.done(), eng.stats()["waiting"], eng.sleep_level)
        await eng.wake_up()
        await asyncio.wait_for(asyncio.gather(before, after, scored), 60)
        return order, held, before.result(), after.result(), eng.stats()

    order, (after_done, scored_done, waiting, level), before, after, stats = run_engine(tiny_model_path, body)
    assert order[:2] == ["before", "sleep"] and sorted(order[2:]) == ["after", "scored"]
    assert not after_done and not scored_done and waiting == 1 and level == 1
    assert len(before.output_token_ids) == 200 and len(after.output_token_ids) == 5
    assert stats["prompt_logprobs_requests"] == 1 and stats["prompt_logprobs_tokens"] == len(PROMPTS[1])


def test_while_paused_an_update_that_need_not_wait_lands_and_scoring_waits_for_resume(tiny_model_path):
    """Paused: a weight update that needs no running sequence to finish goes at once; prompt scoring is held until
    ``resume`` and then scores under the new weights."""

    async def body(eng):
        await eng.pause()
        scored = asyncio.create_task(eng.prompt_logprobs([PROMPTS[3]]))
        await asyncio.sleep(0)
        await asyncio.wait_for(eng.update_weights(_perturbed(tiny_model_path), 7, wait_for_inflight=False), 60)
        await asyncio.sleep(0.3)
        held = (scored.done(), eng.weight_version)
        await eng.resume()
        return held, await asyncio.wait_for(scored, 60)

    (scored_done, version), [result] = run_engine(tiny_model_path, body)
    assert not scored_done and version == 7
    assert result.weight_version == 7 and result.logprobs[0] is None and len(result.logprobs) == len(PROMPTS[3])
