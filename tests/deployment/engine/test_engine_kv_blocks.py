"""The KV cache as a pool of blocks: memory grows with the tokens held, a group's prompt is stored once, a pool too
small for the traffic preempts and recomputes without changing an output, a request that can never fit is refused
naming the setting, and a full waiting queue answers 503 without losing what it accepted (real engine and server,
tiny model)."""

from __future__ import annotations

import asyncio
import random

import aiohttp
import pytest

from training.deployment.engine import SamplingParams
from tests.deployment.engine.test_engine import greedy, kv_bytes, require_native, run_engine

API_KEY = "blocks-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}


def blocks_of(positions: int, block_size: int = 16) -> int:
    return -(-positions // block_size)


SERVER = dict(api_key=API_KEY, served_model_name="tiny", kv_block_size=16)


@pytest.fixture(scope="module")
def big_server(embedded_server):
    """64 sequences x 4096 tokens, the default budget (which the old cache preallocated whole); 2 may wait.
    Fresh: a test pauses it, and the tests count the blocks it holds."""
    return embedded_server(fresh=True, **SERVER, max_batch_size=64, max_model_len=4096, max_waiting=2)


async def _stats(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/stats") as r:
        assert r.status == 200
        return await r.json()


async def _complete(s: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int, stream: bool = False):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": stream}
    body["return_token_ids"] = True
    async with s.post(url + "/v1/completions", json=body) as r:
        return r.status, dict(r.headers), (await r.text() if stream else await r.json())


def test_memory_in_use_grows_with_the_tokens_held_not_with_batch_times_length(big_server):
    """The pool is a budget, not a preallocation: after a 20-token and a 100-token request the blocks that hold K/V
    (and, on CPU, the resident part of the pool) are exactly those the tokens need."""
    rng = random.Random(0)
    short, long = [rng.randrange(3, 500) for _ in range(20)], [rng.randrange(3, 500) for _ in range(100)]

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            url = big_server.base_url
            before = (await _stats(s, url))["kv_cache"]
            seen = []
            for prompt, n in ((short, 10), (long, 50)):
                status, _, out = await _complete(s, url, prompt, n)
                assert status == 200, out
                seen.append((await _stats(s, url))["kv_cache"])
            return before, seen

    before, (after_short, after_long) = asyncio.run(go())
    assert before["blocks_used"] == before["blocks_cached"] == 0 and before["resident_bytes"] == 0
    total = before["blocks_total"]
    assert total <= 64 * 4096 // 16  # the budget: never more than max_batch_size x max_model_len tokens
    held_short, held_long = blocks_of(20 + 10 - 1), blocks_of(100 + 50 - 1)
    assert after_short["blocks_cached"] == held_short and after_short["blocks_used"] == 0
    assert after_long["blocks_cached"] == held_short + held_long  # finished requests' blocks stay as cache
    per_block = after_long["bytes_total"] // total
    assert after_long["resident_bytes"] == (held_short + held_long) * per_block  # only the blocks handed out
    assert after_long["resident_bytes"] < after_long["bytes_total"] / 100


def test_a_full_waiting_queue_answers_503_with_retry_after_and_loses_nothing(big_server):
    """max_waiting=2: with the engine paused, two requests wait; a third (plain or streamed) gets 503 naming
    the limit, with Retry-After; after resume both accepted requests finish in full."""
    prompt = [5, 6, 7, 8, 9]

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            url = big_server.base_url
            async with s.post(url + "/pause") as r:
                assert r.status == 200
            try:
                accepted = [asyncio.ensure_future(_complete(s, url, prompt, 6)) for _ in range(2)]
                while (await _stats(s, url))["waiting"] < 2:
                    await asyncio.sleep(0.02)
                refused = await _complete(s, url, prompt, 6)
                refused_stream = await _complete(s, url, prompt, 6, stream=True)
            finally:
                async with s.post(url + "/resume") as r:
                    assert r.status == 200
            return refused, refused_stream, await asyncio.gather(*accepted)

    refused, refused_stream, accepted = asyncio.run(go())
    for status, headers, body in (refused, refused_stream):
        assert status == 503 and headers["Retry-After"] == "1"
        assert "max_waiting=2" in str(body) and "server_busy" in str(body)
    for status, _, out in accepted:
        assert status == 200 and len(out["choices"][0]["token_ids"]) == 6


def test_a_request_that_can_never_fit_the_pool_gets_a_400_naming_the_setting(embedded_server, tiny_model_path):
    """A pool of 4 blocks of 16 tokens: 20 + 50 tokens fit (alone: preemption would make room), 20 + 60 do not, nor
    does an 80-token prompt; the answer names the field to lower and the setting to raise."""
    with embedded_server(
        fresh=True, **SERVER, max_batch_size=4, max_model_len=512, kv_cache_memory_bytes=kv_bytes(tiny_model_path, 4)
    ) as dep:

        async def go():
            async with aiohttp.ClientSession(headers=AUTH) as s:
                return [await _complete(s, dep.base_url, [7] * p, n) for p, n in ((20, 45), (20, 60), (80, 1))]

        fits, too_long, too_big_prompt = asyncio.run(go())
    assert fits[0] == 200 and len(fits[2]["choices"][0]["token_ids"]) == 45
    for (status, _, body), param in ((too_long, "max_tokens"), (too_big_prompt, "prompt")):
        assert status == 400, body
        assert body["error"]["param"] == param and "kv_cache_memory_bytes" in body["error"]["message"]


def test_a_groups_prompt_blocks_are_stored_once(tiny_model_path):
    """8 completions of one 64-token prompt (admitted in one step): the prompt's 4 full blocks are held by all 8
    (reference count 8) and stored once; each member's own tokens take blocks of its own."""
    prompt = [random.Random(1).randrange(3, 500) for _ in range(64)]
    params = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True) for i in range(8)]

    async def body(eng):
        await eng.pause()
        streams = [eng.generate_stream(prompt, p) for p in params]
        firsts = [asyncio.ensure_future(s.__anext__()) for s in streams]
        while eng.stats()["waiting"] < 8:
            await asyncio.sleep(0.005)
        await eng.resume()
        await asyncio.gather(*firsts)
        await eng.pause()  # mid-generation: every member running
        sched = eng.engine.scheduler
        tables = [s.block_table for s in sched.running]
        cached = [s.num_cached for s in sched.running]
        refs = [sched.blocks.ref[b] for b in tables[0][:4]]
        used = eng.stats()["kv_cache"]["blocks_used"]
        await eng.resume()
        for s in streams:
            async for _ in s:
                pass
        return tables, cached, refs, used

    tables, cached, refs, used = run_engine(tiny_model_path, body, max_batch_size=8, kv_block_size=16)
    assert len(tables) == 8 and refs == [8] * 4
    assert all(t[:4] == tables[0][:4] for t in tables)  # the same physical blocks
    own = sum(blocks_of(n) - 4 for n in cached)
    assert used == 4 + own < 8 * blocks_of(64)  # stored once: less than one copy of the prompt per member


@pytest.mark.parametrize("decode_kernel", ["native", "torch"])
def test_preempted_sequences_continue_exactly_as_without_preemption(tiny_model_path, decode_kernel):
    """Ten concurrent requests (seeded sampling, greedy, one streamed) over a pool of 10 blocks that cannot hold
    them all: running sequences are preempted and recomputed, yet every request gets the tokens and per-token
    weight versions of a pool large enough for all (logprobs to fp32 rounding: recomputed K/V comes from the
    prefill's kernels), each streamed token once, and per-request generators are never re-seeded nor advanced twice."""
    if decode_kernel == "native":
        require_native()
    rng = random.Random(2)
    stem = [rng.randrange(3, 500) for _ in range(20)]
    requests = []
    for i in range(10):
        prompt = (stem if i % 3 == 0 else []) + [rng.randrange(3, 500) for _ in range(rng.randint(4, 24))]
        params = (
            greedy(30 + i)
            if i % 4 == 3
            else SamplingParams(max_tokens=30 + i, temperature=1.0, seed=i, ignore_eos=True)
        )
        requests.append((prompt, params))

    async def body(eng):
        streamed = []

        async def stream(prompt, params):
            async for delta in eng.generate_stream(prompt, params):
                streamed.extend(delta.token_ids)
                if delta.result is not None:
                    return delta.result

        await eng.pause()  # all admitted together: the pool runs out as they grow
        tasks = [asyncio.ensure_future(stream(*requests[0]))]
        tasks += [asyncio.ensure_future(eng.generate(p, sp)) for p, sp in requests[1:]]
        while eng.stats()["waiting"] < len(requests):
            await asyncio.sleep(0.005)
        await eng.resume()
        results = await asyncio.gather(*tasks)
        return results, streamed, eng.stats()

    small, streamed, stats = run_engine(
        tiny_model_path,
        body,
        max_batch_size=10,
        decode_kernel=decode_kernel,
        kv_cache_memory_bytes=kv_bytes(tiny_model_path, 10),
        kv_block_size=16,
    )
    large, _, large_stats = run_engine(tiny_model_path, body, max_batch_size=10, decode_kernel=decode_kernel)
    assert stats["preemptions"] > 0 and large_stats["preemptions"] == 0
    assert stats["preempted_recomputed_tokens"] + stats["cached_prompt_tokens"] > 0
    for s, big in zip(small, large):
        assert s.output_token_ids == big.output_token_ids
        assert s.token_weight_versions == big.token_weight_versions
        assert s.output_logprobs == pytest.approx(big.output_logprobs, abs=1e-5)
    assert streamed == small[0].output_token_ids  # every token streamed once, none again after a preemption
