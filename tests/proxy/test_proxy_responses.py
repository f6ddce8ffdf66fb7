"""``/v1/responses`` through the proxy, with the real ``openai`` SDK, the real proxy and the real server (tiny model).

Each call is recorded exactly like a chat call: the recorded prompt ids, output ids and logprobs are checked
token for token against the server's own ``/v1/responses`` answer to the same request (same seed), plain,
with a forced function call and a ``function_call_output`` round trip, streamed (relayed and synthesised),
and continued by ``previous_response_id`` within a session.
"""

import asyncio
import json

import openai
import pytest

from training.deployment.engine.constraints import missing_library
from training.proxy import ProxyServer

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city, in degrees Celsius.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 6}},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]
needs_llguidance = pytest.mark.skipif(missing_library() is not None, reason="needs llguidance (training[constrained])")


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8, max_model_len=1024)


async def direct(server, **kwargs):
    """The same Responses request straight to the server, with its token ids and logprobs (the ground truth)."""
    c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    extra = {**kwargs.pop("extra_body", {}), "return_token_ids": True}
    r = await c.responses.create(include=["message.output_text.logprobs"], extra_body=extra, **kwargs)
    return r.model_extra


def assert_recorded_exactly(call, truth):
    assert call.prompt_ids == truth["prompt_token_ids"] and call.output_ids == truth["token_ids"]
    assert call.output_logprobs == pytest.approx([e["logprob"] for e in truth["logprobs"]["content"]], abs=1e-4)
    assert call.output_weight_versions == truth["token_weight_versions"] and call.endpoint == "chat"


def test_a_plain_response_is_recorded_token_for_token_and_the_agent_sees_a_plain_response(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("r1"), api_key=proxy.api_key, max_retries=0)
            kwargs = {
                "input": "Hi there",
                "instructions": "Be brief.",
                "max_output_tokens": 8,
                "extra_body": {"seed": 4},
            }
            r = await c.responses.create(model="gpt-agent", **kwargs)
            return r, await direct(server, **kwargs), proxy.close_session("r1")

    r, truth, session = asyncio.run(go())
    [call] = session.calls
    assert_recorded_exactly(call, truth)
    assert r.model == "gpt-agent" and r.output_text and r.usage.output_tokens == len(call.output_ids)
    assert "token_ids" not in r.model_extra and "logprobs" not in r.model_extra  # not asked for
    assert call.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    assert call.label.kind == "NEW" and call.constraint is None and call.trainable


@needs_llguidance
def test_a_forced_call_and_its_output_round_trip_by_previous_response_id_are_recorded_and_labelled(server):
    """tool_choice required: a function_call item, recorded as a constrained call (excluded by default); the
    tool's output goes back by previous_response_id: the next call APPENDs, its prompt is the server's for the
    whole conversation sent explicitly."""

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("r2"), api_key=proxy.api_key, max_retries=0)
            first = await c.responses.create(
                model="gpt-agent",
                input=[{"role": "user", "content": "Weather in Oslo?"}],
                instructions="Use tools.",
                tools=TOOLS,
                tool_choice="required",
                max_output_tokens=60,
                extra_body={"seed": 8},
            )
            [fc] = [o for o in first.output if o.type == "function_call"]
            result = {"type": "function_call_output", "call_id": fc.call_id, "output": "12 degrees"}
            follow = {"instructions": "Use tools.", "tools": TOOLS, "max_output_tokens": 6, "extra_body": {"seed": 9}}
            second = await c.responses.create(
                model="gpt-agent", previous_response_id=first.id, input=[result], **follow
            )
            explicit = [{"role": "user", "content": "Weather in Oslo?"}, fc.model_dump(exclude_none=True), result]
            truth = await direct(server, input=explicit, **follow)
            return fc, second, truth, proxy.close_session("r2")

    fc, second, truth, session = asyncio.run(go())
    first_call, second_call = session.calls
    assert fc.name == "get_weather" and len(json.loads(fc.arguments)["city"]) <= 6
    assert first_call.constraint == {"tool_choice": "required"} and not first_call.trainable
    assert first_call.response_message["tool_calls"][0]["id"] == fc.call_id
    assert second_call.label.kind == "APPEND" and second_call.label.parent == 0
    assert_recorded_exactly(second_call, truth)
    assert second_call.messages[-1] == {"role": "tool", "tool_call_id": fc.call_id, "content": "12 degrees"}
    assert second.previous_response_id is not None


@pytest.mark.parametrize("upstream_stream", ["on", "off"])
def test_a_streamed_response_is_recorded_exactly_relayed_or_synthesised(server, upstream_stream):
    async def go():
        async with ProxyServer([server.base_url], upstream_stream=upstream_stream) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("r3"), api_key=proxy.api_key, max_retries=0)
            kwargs = {"input": "Tell me a story", "max_output_tokens": 12, "extra_body": {"seed": 6}}
            events = [e async for e in await c.responses.create(model="gpt-agent", stream=True, **kwargs)]
            return events, await direct(server, **kwargs), proxy.close_session("r3")

    events, truth, session = asyncio.run(go())
    [call] = session.calls
    assert_recorded_exactly(call, truth)
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and events[-1].response.model == "gpt-agent"


def test_previous_response_id_works_within_its_session_only(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            a = openai.AsyncOpenAI(base_url=proxy.session_url("a"), api_key=proxy.api_key, max_retries=0)
            b = openai.AsyncOpenAI(base_url=proxy.session_url("b"), api_key=proxy.api_key, max_retries=0)
            first = await a.responses.create(model="m", input="Hello", max_output_tokens=4)
            again = await a.responses.create(
                model="m", input="More", previous_response_id=first.id, max_output_tokens=4
            )
            with pytest.raises(openai.NotFoundError) as e:
                await b.responses.create(model="m", input="x", previous_response_id=first.id, max_output_tokens=4)
            with pytest.raises(openai.BadRequestError) as refused:
                await a.responses.create(model="m", input="x", reasoning={"effort": "high"})
            return first, again, e.value.body, refused.value.body, proxy.close_session("a"), proxy.close_session("b")

    first, again, missing, refused, sa, sb = asyncio.run(go())
    assert missing["param"] == "previous_response_id" and "in this session" in missing["message"]
    assert refused["param"] == "reasoning"
    assert len(sa.calls) == 2 and sb.calls == []  # refused calls are not recorded
    assert sa.calls[1].label.kind == "APPEND"
    assert sa.calls[1].messages[:2] == [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
    ]
    assert again.previous_response_id == first.id


def test_the_rl_extras_reach_the_agent_when_it_asks(server):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("r5"), api_key=proxy.api_key, max_retries=0)
            r = await c.responses.create(
                model="m",
                input="Hi",
                max_output_tokens=5,
                include=["message.output_text.logprobs"],
                extra_body={"return_token_ids": True},
            )
            return r, proxy.close_session("r5")

    r, session = asyncio.run(go())
    [call] = session.calls
    assert r.model_extra["token_ids"] == call.output_ids and r.model_extra["prompt_token_ids"] == call.prompt_ids
    assert [e["logprob"] for e in r.model_extra["logprobs"]["content"]] == pytest.approx(call.output_logprobs)
