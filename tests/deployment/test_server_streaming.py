"""Streaming (OpenAI chunks over server-sent events) and client-disconnect cancellation, over real HTTP.

One server subprocess on the tiny model for the module; the ``openai`` SDK is the client. The tests
that need a sequence held mid-generation serve an in-process engine instead (``HeldEngine``).
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.held_engine import HeldEngine
from training.deployment.engine.requests import GenerationDelta, GenerationResult, SamplingParams
from training.deployment.server.protocol import ParsedRequest
from training.deployment.server.bodies import build_chat_response
from training.deployment.server.streaming import ChunkStream, IncrementalText

openai = pytest.importorskip("openai")

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "evaluate arithmetic",
            "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
        },
    }
]
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def server(embedded_server):
    # no prefix caching: a reused prefix's K/V differs from a fresh prefill in the 7th digit, and these tests
    # compare a streamed request with the same request answered whole, digit for digit
    return embedded_server(max_model_len=MAX_MODEL_LEN, max_batch_size=8, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def extra(obj, name):
    return (obj.model_extra or {}).get(name)


def test_streamed_completions_equal_the_whole_response_token_for_token(client):
    body = dict(
        model="tiny-qwen3",
        prompt=[PROMPT, PROMPT[:5]],
        max_tokens=20,
        temperature=1.0,
        seed=11,
        n=2,
        logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    whole = client.completions.create(**body)
    chunks = list(client.completions.create(**body, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1]) and all(len(c.choices) == 1 for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1
    order = [c.choices[0].index for c in chunks[:-1]]
    assert sorted(set(order)) == [0, 1, 2, 3] and order != sorted(order)  # choices interleave
    for want in whole.choices:
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == want.index]
        assert extra(mine[0], "prompt_token_ids") == extra(want, "prompt_token_ids")
        assert sum((extra(c, "token_ids") for c in mine), []) == extra(want, "token_ids")
        versions = sum((extra(c, "token_weight_versions") for c in mine), [])
        assert versions == (
            extra(want, "token_weight_versions") or [extra(want, "weight_version")] * len(extra(want, "token_ids"))
        )
        assert "".join(c.text for c in mine) == want.text
        lps = [c.logprobs for c in mine if c.logprobs]
        assert sum((lp.token_logprobs for lp in lps), []) == want.logprobs.token_logprobs
        assert sum((lp.top_logprobs for lp in lps), []) == want.logprobs.top_logprobs
        assert sum((lp.text_offset for lp in lps), []) == want.logprobs.text_offset
        assert [c.finish_reason for c in mine] == [None] * (len(mine) - 1) + [want.finish_reason]
        assert extra(mine[-1], "weight_version") == extra(whole, "weight_version")


@pytest.mark.parametrize("tools", [None, TOOLS], ids=["plain", "with-tools"])
def test_streamed_chat_equals_the_whole_response(client, tools):
    from openai.lib.streaming.chat import ChatCompletionStreamState

    body = dict(
        model="tiny-qwen3",
        messages=CHAT,
        max_tokens=24,
        temperature=1.0,
        seed=5,
        n=2,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_token_ids": True, "ignore_eos": True},
        **({"tools": tools} if tools else {}),
    )
    whole = client.chat.completions.create(**body)
    state = ChatCompletionStreamState()
    chunks = []
    for chunk in client.chat.completions.create(**body, stream=True, stream_options={"include_usage": True}):
        state.handle_chunk(chunk)
        chunks.append(chunk)
    final = state.current_completion_snapshot  # (get_final_completion refuses a 'length' finish)
    assert final.usage.completion_tokens == whole.usage.completion_tokens
    for want in whole.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == want.index]
        assert mine[0].delta.role == "assistant"
        assert extra(mine[0], "prompt_token_ids") == extra(want, "prompt_token_ids")
        assert sum((extra(c, "token_ids") or [] for c in mine), []) == extra(want, "token_ids")
        got = final.choices[want.index]
        assert got.message.content == want.message.content
        assert got.finish_reason == want.finish_reason and not got.message.tool_calls
        assert [e.model_dump() for e in got.logprobs.content] == [e.model_dump() for e in want.logprobs.content]


def test_a_stop_string_is_never_streamed(client):
    body = dict(
        model="tiny-qwen3", prompt=PROMPT, max_tokens=60, temperature=1.0, seed=3, extra_body={"ignore_eos": True}
    )
    text = client.completions.create(**body).choices[0].text
    k = next(i for i in range(len(text) // 2, 0, -1) if text.find(text[i : i + 4]) == i)
    stop = text[k : k + 4]
    whole = client.completions.create(**body, stop=[stop]).choices[0]
    pieces = [c.choices[0].text for c in client.completions.create(**body, stop=[stop], stream=True)]
    assert whole.text == text[:k] and whole.finish_reason == "stop" and whole.model_extra["stop_reason"] == stop
    assert "".join(pieces) == whole.text and not any(stop in p for p in pieces)


def test_incremental_text_holds_back_split_characters(tokenizer):
    text = "naïve café: 你好, 世界 → ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text) // 2  # byte-level: several characters span several tokens
    stream = IncrementalText(tokenizer, stop=[])
    pieces = [stream.add([t]) for t in ids]
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + stream.finish(tokenizer.decode(ids, skip_special_tokens=True)) == text


SCRIPTS = [
    'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>',
    '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "lookup", "arguments": "{\\"q\\": \\"five\\"}"}\n</tool_call>\nDone, twice.',
    "The answer is 5 and < is not a tag.  ",
    'Trailing unclosed: <tool_call>{"name": "calculator", "arguments": {"expression": "7*6"}}',
]


@pytest.mark.parametrize("script", SCRIPTS, ids=["before", "two-calls-after", "no-call", "unclosed"])
def test_tool_calls_stream_in_the_openai_chat_format(tokenizer, script):
    """The model (random weights) cannot be made to write a tool call, so its tokens are scripted: the
    real tokenizer's ids, fed to the server's chunk builder one token per delta, accumulated by the
    openai SDK, give the same message as the whole response."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    ids = tokenizer.encode(script, add_special_tokens=False)
    result = GenerationResult(
        [1, 2], ids, [-0.5] * len(ids), "stop", 0, 0, tokenizer.decode(ids, skip_special_tokens=True)
    )
    req = ParsedRequest(
        prompts=[[1, 2]],
        n=1,
        params=SamplingParams(),
        seed=None,
        logprobs=None,
        return_token_ids=True,
        model="tiny",
        tools=TOOLS,
        parse_tool_calls=True,
        stream=True,
    )
    chunks = ChunkStream(req, chat=True, tokenizer=tokenizer)
    raw = chunks.opening()
    for t in ids[:-1]:
        raw += chunks.update(0, 0, GenerationDelta([t], [-0.5], None))
    raw += chunks.update(0, 0, GenerationDelta(ids[-1:], [-0.5], None, result=result))
    state = ChatCompletionStreamState()
    for c in raw:
        state.handle_chunk(ChatCompletionChunk.model_validate(json.loads(json.dumps(c))))
    got = state.get_final_completion().choices[0]
    want = build_chat_response(req, [result], tokenizer)["choices"][0]
    assert got.finish_reason == want["finish_reason"]
    assert (got.message.content or None) == want["message"]["content"]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in want["message"]["tool_calls"]
    ]
    assert sum((c["choices"][0].get("token_ids", []) for c in raw), []) == ids
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in raw if c["choices"][0]["delta"].get("tool_calls")]
    for first, args in zip(calls[::2], calls[1::2]):  # per call: id + name, then the arguments
        assert first["id"] and first["type"] == "function" and first["function"]["arguments"] == ""
        assert set(args) == {"index", "function"} and args["index"] == first["index"]
    if "<tool_call>" in script:
        assert want["finish_reason"] == "tool_calls" and want["message"]["tool_calls"]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_disconnected_client_has_its_sequence_aborted_and_slot_freed(tiny_model_path, stream):
    """The engine is held mid-generation, the client goes away, the abort lands while paused; after
    resuming, the sequence generates nothing more and its slot is free."""
    max_tokens = 400

    async def go():
        async with HeldEngine(tiny_model_path, hold_after=20) as held, aiohttp.ClientSession() as s:
            before = held.eng.stats()
            body = {"prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
            task = asyncio.ensure_future(s.post(held.base_url + "/v1/completions", json=body))
            paused = await held.pause_when_held()
            if stream:
                resp = await task
                first = await asyncio.wait_for(resp.content.readline(), 20)  # the tokens before the hold
                assert first.startswith(b"data: ") and json.loads(first[6:])["choices"]
                resp.close()
            else:
                assert not task.done()
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            deadline = time.monotonic() + 20
            while held.eng.stats()["requests_aborted"] == before["requests_aborted"]:  # a paused engine aborts
                assert time.monotonic() < deadline, "the disconnect was never noticed"
                await asyncio.sleep(0.01)
            await held.eng.resume()
            while held.eng.stats()["running"] and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return before, paused, held.eng.stats()

    before, paused, after = asyncio.run(go())
    assert paused["running"] == 1  # still generating when the client left
    assert after["running"] == 0 and after["kv_cache"]["blocks_used"] == before["kv_cache"]["blocks_used"] == 0
    assert after["requests_aborted"] == before["requests_aborted"] + 1
    assert after["tokens_generated"] == paused["tokens_generated"]  # nothing generated after the disconnect
    assert after["tokens_generated"] - before["tokens_generated"] < max_tokens


class _AbortRecordingEngine:
    """Wraps ``AsyncEngine.abort`` to note how many tokens the sequence had when the abort was asked.

    The note is taken under the engine's (re-entrant) lock, in the same critical section that
    queues the abort, so at most the one step already running can add a token after it.
    """

    @staticmethod
    def install(eng):
        notes = []
        original = eng.abort

        def abort(seq):
            with eng._cond:
                notes.append((seq, seq.num_output_tokens))
                original(seq)

        eng.abort = abort
        return notes


@pytest.mark.parametrize("how", ["closed stream", "cancelled generate"])
def test_an_abort_lands_within_one_engine_step(tiny_model_path, how):
    from training.deployment.engine import AsyncEngine, EngineConfig

    async def go():
        eng = AsyncEngine(
            EngineConfig(model=tiny_model_path, max_batch_size=4, max_model_len=512, device="cpu", dtype="float32")
        )
        await eng.start()
        notes = _AbortRecordingEngine.install(eng)
        try:
            params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
            other = asyncio.ensure_future(eng.generate(PROMPT[:4], SamplingParams(max_tokens=60, ignore_eos=True)))
            if how == "closed stream":
                stream = eng.generate_stream(PROMPT, params)
                async for _ in stream:
                    if eng.engine.counters["tokens_generated"] > 10:
                        break
                await stream.aclose()
            else:
                task = asyncio.ensure_future(eng.generate(PROMPT, params))
                while eng.engine.counters["tokens_generated"] < 10:
                    await asyncio.sleep(0.005)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            kept = await other
            while eng.stats()["running"]:
                await asyncio.sleep(0.01)
            return notes, kept, eng.stats()
        finally:
            await eng.shutdown()

    notes, kept, stats = asyncio.run(go())
    [(seq, tokens_at_abort)] = notes
    assert seq.finish_reason == "abort"
    assert seq.num_output_tokens - tokens_at_abort <= 1  # only the step already under way may add one
    assert seq.num_output_tokens < 400
    assert len(kept.output_token_ids) == 60 and kept.finish_reason == "length"  # the other request went on
    assert stats["requests_aborted"] == 1 and stats["kv_cache"]["blocks_used"] == 0


def test_a_weight_push_whose_client_gives_up_still_lands(tiny_model_path):
    """Handler cancellation applies to generation only: a control request runs to its end."""

    async def go():
        async with HeldEngine(tiny_model_path, hold_after=20) as held, aiohttp.ClientSession() as s:
            version = held.eng.weight_version
            body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
            gen = asyncio.ensure_future(s.post(held.base_url + "/v1/completions", json=body))
            await held.pause_when_held()  # held mid-generation
            push = {
                "path": f"{tiny_model_path}/model.safetensors",
                "weight_version": version + 1,
                "wait_for_inflight": True,
            }  # waits for the running generation: the client gives up first
            try:
                with pytest.raises(asyncio.TimeoutError):
                    await s.post(
                        held.base_url + "/update_weights_from_disk",
                        json=push,
                        timeout=aiohttp.ClientTimeout(total=0.1),
                    )
            finally:
                await held.eng.resume()
            (await gen).release()
            deadline = time.monotonic() + 60
            while held.eng.weight_version != version + 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            return version, held.eng.weight_version

    version, now = asyncio.run(go())
    assert now == version + 1


def test_streamed_tokens_carry_the_weight_version_that_sampled_them(tiny_model_path):
    from safetensors.torch import load_file

    from training.deployment.engine import AsyncEngine, EngineConfig

    weights = load_file(f"{tiny_model_path}/model.safetensors")

    async def go():
        eng = AsyncEngine(
            EngineConfig(model=tiny_model_path, max_batch_size=2, max_model_len=512, device="cpu", dtype="float32")
        )
        await eng.start()
        try:
            versions, updated = [], False
            async for delta in eng.generate_stream(PROMPT, SamplingParams(max_tokens=300, ignore_eos=True)):
                versions += delta.weight_versions
                if not updated and len(versions) >= 5:  # swapped between two steps of this sequence
                    await eng.pause()  # held mid-sequence however fast the engine; an in-flight update still lands
                    await eng.update_weights(weights, 1, wait_for_inflight=False)
                    await eng.resume()
                    updated = True
                if delta.result is not None:
                    return versions, delta.result
        finally:
            await eng.shutdown()

    versions, result = asyncio.run(go())
    assert len(versions) == len(result.output_token_ids) == 300
    assert versions[0] == 0 and versions[-1] == 1 and versions == sorted(versions)
    assert versions == (getattr(result, "token_weight_versions", None) or versions)
