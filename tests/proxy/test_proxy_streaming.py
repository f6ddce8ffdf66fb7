"""Streaming and the Anthropic Messages API through the proxy, recorded token-exact (real tiny server)."""

import asyncio

import openai
import pytest
from aiohttp import ClientSession

from training.proxy import ProxyServer, stitch_calls
from training.proxy.anthropic import from_chat_response, stream_events, to_chat_request

MESSAGES = [{"role": "system", "content": "You add numbers."}, {"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8, max_model_len=512)


async def direct(server, path, body):
    """The same request straight to the server, with its token ids (the ground truth)."""
    logprobs = True if path.endswith("chat/completions") else 0
    async with ClientSession() as s:
        async with s.post(server.base_url + path, json={**body, "return_token_ids": True, "logprobs": logprobs}) as r:
            assert r.status == 200, await r.text()
            return await r.json()


async def stream_chat(proxy, sid, messages, **kw):
    """The unmodified SDK's streaming call: (chunks, text)."""
    c = openai.AsyncOpenAI(base_url=proxy.session_url(sid), api_key=proxy.api_key, max_retries=0)
    stream = await c.chat.completions.create(model="gpt-x", messages=messages, stream=True, **kw)
    chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    return chunks, text


def test_stream_synthesised_from_a_full_reply_is_recorded_exactly(server):
    """``upstream_stream="off"`` (what ``auto`` falls back to for an upstream that refuses ``stream``): the proxy
    asks without it, records, and streams the reply as SSE."""

    async def go():
        async with ProxyServer([server.base_url], upstream_stream="off") as proxy:
            chunks, text = await stream_chat(
                proxy, "s1", MESSAGES, max_tokens=6, seed=11, stream_options={"include_usage": True}
            )
            history = MESSAGES + [{"role": "assistant", "content": text}, {"role": "user", "content": "Sure?"}]
            await stream_chat(proxy, "s1", history, max_tokens=5, seed=12)
            truth = await direct(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 6, "seed": 11})
            c = openai.AsyncOpenAI(base_url=proxy.session_url("s1"), api_key=proxy.api_key, max_retries=0)
            completion_stream = await c.completions.create(
                model="m", prompt=[1, 30, 31, 32], max_tokens=4, seed=3, stream=True, extra_body={"ignore_eos": True}
            )
            completion_text = "".join([ch.choices[0].text async for ch in completion_stream if ch.choices])
            completion_truth = await direct(
                server, "/v1/completions", {"prompt": [1, 30, 31, 32], "max_tokens": 4, "seed": 3, "ignore_eos": True}
            )
            return chunks, text, truth, (completion_text, completion_truth), proxy.close_session("s1"), proxy

    chunks, text, truth, (completion_text, completion_truth), session, proxy = asyncio.run(go())
    assert not proxy.forwarder.refused_stream  # synthesised by choice, not after a refusal
    first = session.calls[0]
    t = truth["choices"][0]
    assert first.output_ids == t["token_ids"] and first.prompt_ids == t["prompt_token_ids"]
    # a second run of the same seeded request: the same ids; logprobs equal up to batching noise
    assert first.output_logprobs == pytest.approx([e["logprob"] for e in t["logprobs"]["content"]], abs=1e-4)
    assert text == t["message"]["content"] and chunks[-2].choices[0].finish_reason == t["finish_reason"]
    assert chunks[-1].usage.completion_tokens == len(t["token_ids"]) and not chunks[-1].choices
    assert all("token_ids" not in (ch.choices[0].model_extra or {}) for ch in chunks if ch.choices)
    assert [c.label.kind for c in session.calls[:2]] == ["NEW", "APPEND"]
    segments = stitch_calls(session.calls[:2]).samples  # one, or two where the re-render drifted (split)
    trained = [x for seg in segments for x, m in zip(seg.tokens, seg.loss_mask) if m]
    assert trained == session.calls[0].output_ids + session.calls[1].output_ids
    assert (
        session.calls[2].output_ids == completion_truth["choices"][0]["token_ids"]
        and len(session.calls[2].output_ids) == 4
        and completion_text == completion_truth["choices"][0]["text"]
    )


def test_relayed_upstream_stream_reaches_the_agent_chunk_by_chunk_and_is_recorded_exactly(server):
    async def go():
        async with ProxyServer([server.base_url], upstream_stream="on") as proxy:
            relayed = []
            relay = proxy._relay

            async def counting_relay(*args):  # a spy: the real relay, counted when it streamed
                resp = await relay(*args)
                relayed.append(resp is not None and resp.status == 200)
                return resp

            proxy._relay = counting_relay
            # 64 tokens: enough steps that the server's stream cannot hand them all over as one chunk
            chunks, text = await stream_chat(
                proxy, "r1", MESSAGES, max_tokens=64, seed=21, logprobs=True, extra_body={"ignore_eos": True}
            )
            truth = await direct(
                server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 64, "seed": 21, "ignore_eos": True}
            )
            return chunks, text, truth, sum(relayed), proxy.close_session("r1")

    chunks, text, truth, streamed, session = asyncio.run(go())
    t = truth["choices"][0]
    [call] = session.calls
    assert streamed == 1 and len([c for c in chunks if c.choices and c.choices[0].delta.content]) >= 2
    assert call.output_ids == t["token_ids"] and call.prompt_ids == t["prompt_token_ids"]
    assert call.output_logprobs == pytest.approx([e["logprob"] for e in t["logprobs"]["content"]], abs=1e-4)
    assert call.finish_reason == t["finish_reason"] and call.response_message["content"] == text
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)
    assert all(c.usage is None for c in chunks)  # the agent did not ask for the usage chunk
    streamed_logprobs = [
        e.logprob for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert streamed_logprobs == call.output_logprobs  # asked for: relayed as they came


def test_anthropic_sdk_through_the_proxy_is_recorded_and_streams(server):
    anthropic = pytest.importorskip("anthropic")

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            base = f"http://127.0.0.1:{proxy.port}/sessions/a1"  # the SDK appends /v1/messages
            client = anthropic.AsyncAnthropic(base_url=base, api_key=proxy.api_key, max_retries=0)
            first = await client.messages.create(
                model="claude-x",
                max_tokens=5,
                system="You add numbers.",
                messages=[{"role": "user", "content": "What is 2 + 3?"}],
            )
            follow = [
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                {"role": "user", "content": "Sure?"},
            ]
            async with client.messages.stream(
                model="claude-x", max_tokens=4, system="You add numbers.", messages=follow
            ) as stream:
                streamed_text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
                await client.messages.create(model="claude-x", max_tokens=0, messages=follow)
            return first, streamed_text, final, proxy.close_session("a1")

    first, streamed_text, final, session = asyncio.run(go())
    assert first.model == "claude-x" and first.stop_reason in ("end_turn", "max_tokens")
    assert first.usage.output_tokens == len(session.calls[0].output_ids)
    assert [c.label.kind for c in session.calls] == ["NEW", "APPEND"]
    assert session.calls[0].messages[0] == {"role": "system", "content": "You add numbers."}
    assert final.usage.output_tokens == len(session.calls[1].output_ids) and final.content[0].text == streamed_text


def test_anthropic_tool_use_history_translates_both_ways():
    body = {
        "model": "c",
        "max_tokens": 9,
        "system": [{"type": "text", "text": "sys"}],
        "tools": [{"name": "calc", "description": "d", "input_schema": {"type": "object"}}],
        "messages": [
            {"role": "user", "content": "2+3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "let me"},
                    {"type": "tool_use", "id": "tu1", "name": "calc", "input": {"e": "2+3"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "tu1", "content": "5"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "tu2",
                        "is_error": True,
                        "content": [{"type": "text", "text": "bad"}],
                    },
                    {"type": "text", "text": "go on"},
                ],
            },
        ],
    }
    chat = to_chat_request(body)
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "2+3?"},
        {
            "role": "assistant",
            "content": "let me",
            "tool_calls": [{"id": "tu1", "type": "function", "function": {"name": "calc", "arguments": {"e": "2+3"}}}],
        },
        {"role": "tool", "tool_call_id": "tu1", "content": "5"},
        {"role": "tool", "tool_call_id": "tu2", "content": "Error: bad"},
        {"role": "user", "content": "go on"},
    ]
    assert chat["tools"][0]["function"]["parameters"] == {"type": "object"} and chat["max_tokens"] == 9
    reply = {
        "choices": [
            {
                "finish_reason": "tool_calls",
                "message": {
                    "content": None,
                    "tool_calls": [
                        {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "1+1"}'}}
                    ],
                },
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": 3},
    }
    msg = from_chat_response(reply, "c")
    assert msg["content"] == [{"type": "tool_use", "id": "call_1", "name": "calc", "input": {"e": "1+1"}}]
    assert msg["stop_reason"] == "tool_use" and msg["usage"] == {"input_tokens": 7, "output_tokens": 3}
    kinds = [e for e, _ in stream_events(msg)]
    assert kinds == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    with pytest.raises(ValueError, match=r"messages\[0\].content\[0\]"):
        to_chat_request({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image"}]}]})
