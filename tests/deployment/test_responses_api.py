"""``POST /v1/responses`` on the embedded server, through the real ``openai`` SDK (tiny model).

- The Responses request means a chat request (``training/openai_api/responses_request.py``): the same seed gives
  the same tokens as ``/v1/chat/completions`` with the translated messages, so every chat guarantee
  (tools in the prompt, constrained decoding, masked logprobs) carries over.
- ``previous_response_id`` continues the stored conversation; an unknown or unstored id is a 404 naming it.
- Streaming: the events the SDK parses, in order, whose deltas add up to the final response.
- Fields the server cannot honour are refused with a 400 naming them.
The translation itself is tested without a server at the bottom (``unit``).
"""

import asyncio
import json

import openai
import pytest
from aiohttp import ClientSession

from training.deployment.engine.constraints import missing_library
from training.openai_api.responses_request import ResponsesRequestError, input_messages, parse_responses_request
from training.openai_api.responses_store import ResponseStore

CITY = {"type": "string", "maxLength": 6}
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city, in degrees Celsius.",
        "parameters": {
            "type": "object",
            "properties": {"city": CITY},
            "required": ["city"],
            "additionalProperties": False,
        },
        "strict": True,
    }
]
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {k: TOOLS[0][k] for k in ("name", "parameters", "description")},
    }
]
needs_llguidance = pytest.mark.skipif(missing_library() is not None, reason="needs llguidance (training[constrained])")


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8, max_model_len=1024)


def client(server):
    return openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


async def chat(server, body):
    async with ClientSession() as s:
        payload = {**body, "return_token_ids": True, "logprobs": True}
        async with s.post(server.base_url + "/v1/chat/completions", json=payload) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def extras(response):
    return response.model_extra or {}


def test_a_plain_response_is_the_chat_reply_of_the_same_conversation_token_for_token(server):
    """Both routes are compared on a warm prefix cache: a cold request prefills the whole prompt where a warm one
    prefills its last block's tokens beside cached K/V, and on CPUs whose GEMM rounds by row count (seen on an AMD
    EPYC: one logprob 1 ulp apart) that alone changes the last bits (engine/README.md, "Batch invariance")."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]

    async def go():
        await chat(server, {"messages": messages, "max_tokens": 8, "seed": 11})  # warms the cache for both
        r = await client(server).responses.create(
            input="Hi there",
            instructions="Be brief.",
            max_output_tokens=8,
            include=["message.output_text.logprobs"],
            extra_body={"return_token_ids": True, "seed": 11},
        )
        return r, await chat(server, {"messages": messages, "max_tokens": 8, "seed": 11})

    r, truth = asyncio.run(go())
    t = truth["choices"][0]
    x = extras(r)
    assert x["prompt_token_ids"] == truth["prompt_token_ids"] and x["token_ids"] == t["token_ids"]
    assert [e["logprob"] for e in x["logprobs"]["content"]] == [e["logprob"] for e in t["logprobs"]["content"]]
    assert x["token_weight_versions"] == t["token_weight_versions"] and x["weight_version"] == 0
    assert r.output_text == t["message"]["content"]
    [item] = r.output
    assert item.type == "message" and len(item.content[0].logprobs) == len(
        t["token_ids"]
    )  # text only: the part has them
    assert r.usage.input_tokens == len(x["prompt_token_ids"]) and r.usage.output_tokens == len(x["token_ids"])
    assert r.status == ("incomplete" if t["finish_reason"] == "length" else "completed")
    assert r.object == "response" and r.instructions == "Be brief." and r.id.startswith("resp_")


@needs_llguidance
def test_a_forced_function_call_round_trips_through_previous_response_id(server):
    """tool_choice required -> a function_call item; its output goes back by previous_response_id; the
    follow-up's prompt is the chat prompt of the whole conversation (instructions given again, as OpenAI)."""

    async def go():
        c = client(server)
        first = await c.responses.create(
            input=[{"role": "user", "content": "Weather in Oslo?"}],
            instructions="Use tools.",
            tools=TOOLS,
            tool_choice="required",
            max_output_tokens=60,
            extra_body={"seed": 2},
        )
        [call] = [o for o in first.output if o.type == "function_call"]
        second = await c.responses.create(
            previous_response_id=first.id,
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "12 degrees"}],
            instructions="Use tools.",
            tools=TOOLS,
            max_output_tokens=6,
            extra_body={"return_token_ids": True, "seed": 3},
        )
        history = [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Oslo?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "12 degrees"},
        ]
        truth = await chat(server, {"messages": history, "tools": CHAT_TOOLS, "max_tokens": 6, "seed": 3})
        return first, call, second, truth

    first, call, second, truth = asyncio.run(go())
    assert first.status == "completed" and call.name == "get_weather" and call.call_id
    assert len(json.loads(call.arguments)["city"]) <= 6  # the schema held (constrained decoding)
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"
    assert extras(second)["prompt_token_ids"] == truth["prompt_token_ids"]
    assert extras(second)["token_ids"] == truth["choices"][0]["token_ids"]
    assert second.previous_response_id == first.id


def test_streamed_events_arrive_in_order_and_add_up_to_the_final_response(server):
    async def go():
        c = client(server)
        events = [
            e
            async for e in await c.responses.create(
                input="Tell me a story",
                max_output_tokens=12,
                stream=True,
                extra_body={"return_token_ids": True, "seed": 5},
            )
        ]
        whole = await c.responses.create(
            input="Tell me a story", max_output_tokens=12, extra_body={"return_token_ids": True, "seed": 5}
        )
        return events, whole

    events, whole = asyncio.run(go())
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert final.output_text == text == events[-2].item.content[0].text == whole.output_text
    assert extras(final)["token_ids"] == extras(whole)["token_ids"]  # same seed, same tokens, streamed or not
    assert final.output[0].id == events[2].item.id


@needs_llguidance
def test_a_streamed_forced_call_arrives_as_function_call_events(server):
    async def go():
        stream = await client(server).responses.create(
            input="Weather?",
            tools=TOOLS,
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=60,
            stream=True,
        )
        return [e async for e in stream]

    events = asyncio.run(go())
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    [done] = [e for e in events if e.type == "response.function_call_arguments.done"]
    [call] = events[-1].response.output
    assert call.type == "function_call" and call.arguments == done.arguments and call.name == "get_weather"
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


@needs_llguidance
def test_text_format_json_schema_returns_json_that_validates(server):
    schema = {
        "type": "object",
        "properties": {"ok": {"enum": ["yes", "no"]}},
        "required": ["ok"],
        "additionalProperties": False,
    }

    async def go():
        return await client(server).responses.create(
            input="Answer.",
            max_output_tokens=30,
            text={"format": {"type": "json_schema", "name": "a", "schema": schema, "strict": True}},
        )

    r = asyncio.run(go())
    assert json.loads(r.output_text)["ok"] in ("yes", "no")


def test_unknown_or_unstored_previous_response_ids_are_404_naming_the_field(server):
    async def go():
        c = client(server)
        unstored = await c.responses.create(input="Hi", max_output_tokens=2, store=False)
        errors = []
        for rid in ("resp_unknown", unstored.id):
            with pytest.raises(openai.NotFoundError) as e:
                await c.responses.create(input="Hi", previous_response_id=rid, max_output_tokens=2)
            errors.append(e.value.body)
        return errors

    for err in asyncio.run(go()):
        assert err["param"] == "previous_response_id" and "not found" in err["message"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"truncation": "auto"}, "truncation"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"extra_body": {"top_k": 3}}, "top_k"),
        ({"max_output_tokens": 5000}, "max_output_tokens"),  # the chat path's error, named as the client sent it
    ],
)
def test_fields_it_cannot_honour_are_refused_naming_them(server, kwargs, param):
    async def go():
        with pytest.raises(openai.BadRequestError) as e:
            await client(server).responses.create(**{"input": "Hi", **kwargs})
        return e.value.body

    err = asyncio.run(go())
    assert err["param"] == param, err


def test_stored_responses_are_a_bounded_pool_in_stats(server):
    async def go():
        async with ClientSession() as s:
            async with s.get(server.base_url + "/stats") as r:
                return await r.json()

    pool = asyncio.run(go())["pools"]["stored_responses"]
    assert pool["bound"] == 1024 and 0 <= pool["size"] <= pool["bound"]


# ---------------------------------------------------------------- the translation, no server


def test_output_items_in_the_input_become_one_assistant_turn_then_tool_messages():
    items = [
        "Hi",
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "Be "}, {"type": "input_text", "text": "kind"}],
        },
        {
            "id": "msg_1",
            "type": "message",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}],
        },
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": '{"a": 1}'},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"},
    ]
    assert input_messages(items) == [
        {"role": "user", "content": "Hi"},
        {"role": "system", "content": "Be kind"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}},
                {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
        },
    ]


def test_the_chat_body_puts_instructions_then_the_previous_conversation_then_the_input():
    rr = parse_responses_request(
        {
            "input": "next",
            "instructions": "sys",
            "tools": TOOLS,
            "tool_choice": {"type": "function", "name": "get_weather"},
            "text": {"format": {"type": "json_object"}},
            "max_output_tokens": 7,
            "temperature": 0.5,
            "include": [],
            "store": True,
            "metadata": {"k": "v"},
            "parallel_tool_calls": True,
        }
    )
    history = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "ok"}]
    body = rr.chat_body(history)
    assert body["messages"] == [{"role": "system", "content": "sys"}, *history, {"role": "user", "content": "next"}]
    assert body["tools"] == CHAT_TOOLS and body["tool_choice"] == {
        "type": "function",
        "function": {"name": "get_weather"},
    }
    assert body["response_format"] == {"type": "json_object"} and body["max_tokens"] == 7 and body["temperature"] == 0.5
    assert "parallel_tool_calls" not in body and "logprobs" not in body


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"format": {"type": "text"}, "verbosity": "low"}}, "text.verbosity"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"input": "x", "frobnicate": 1}, "frobnicate"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ],
)
def test_requests_it_cannot_serve_name_the_field(body, param):
    with pytest.raises(ResponsesRequestError) as e:
        parse_responses_request(body)
    assert e.value.param == param


def test_the_store_keeps_the_most_recently_used_within_both_bounds():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for rid in ("a", "b"):
        store.put(rid, [{"role": "user", "content": rid}])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", [{"role": "user", "content": "c"}])
    assert "b" not in store and store.get("a") and store.get("c") and store.dropped == 1
    small = ResponseStore(max_responses=10, max_chars=100)
    small.put("big", [{"role": "user", "content": "x" * 200}])
    assert "big" not in small and len(small) == 0
    got = small.get("none")
    assert got is None
