"""Agents on their defaults through the proxy: the real ``openai`` and ``anthropic`` SDKs, the real proxy,
the real server on the tiny model.

- Sampling fields (``training/proxy/sampling_policy.py``, the proxy README's table): fields that would change
  the sampled distribution unseen are refused with a 400 naming them on both routes; neutral values pass;
  forced and recorded fields land on the call; Anthropic ``tool_choice`` is mapped, ``thinking`` refused.
- Tool round trips on each SDK's defaults: the tools reach the prompt, and the recorded call is what the
  server returned, token for token (streamed and not).
"""

import asyncio

import openai
import pytest
from aiohttp import ClientSession

from training.deployment.engine.constraints import missing_library
from training.proxy import ProxyServer, stitch_calls
from training.proxy.records import CallRecord
from training.proxy.sampling_policy import constraint_of, flag
from training.utils.rl.rollout.turn_matching import TurnLabel

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, in degrees Celsius.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
ANTHROPIC_TOOLS = [
    {
        "name": "get_weather",
        "description": "Weather in a city, in degrees Celsius.",
        "input_schema": TOOLS[0]["function"]["parameters"],
    }
]
MESSAGES = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    # fresh: whether a forced call closes within max_tokens depends on what its unseeded requests sample, which
    # depends on every request the server took before (it draws their seeds from one generator)
    return embedded_server(fresh=True, max_batch_size=8, max_model_len=1024)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


async def direct_chat(server, body):
    """The same chat request straight to the server, with its token ids (the ground truth)."""
    async with ClientSession() as s:
        payload = {**body, "return_token_ids": True, "logprobs": True}
        async with s.post(server.base_url + "/v1/chat/completions", json=payload) as r:
            assert r.status == 200, await r.text()
            return await r.json()


def assert_recorded_exactly(call, truth):
    t = truth["choices"][0]
    assert call.prompt_ids == t["prompt_token_ids"] and call.output_ids == t["token_ids"]
    assert call.output_logprobs == pytest.approx([e["logprob"] for e in t["logprobs"]["content"]], abs=1e-4)


@pytest.mark.parametrize(
    "field, value",
    [("logit_bias", {"1000": 100}), ("frequency_penalty", 1.5), ("top_k", 5), ("presence_penalty", 0.5)],
)
def test_openai_sdk_distribution_changing_fields_are_refused_naming_them(server, field, value):
    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("p1"), api_key=proxy.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError) as e:
                await c.chat.completions.create(
                    model="gpt-x", messages=MESSAGES, max_tokens=3, extra_body={field: value}
                )
            with pytest.raises(openai.BadRequestError) as e_completions:
                await c.completions.create(model="m", prompt="Hi", max_tokens=3, extra_body={field: value})
            return e.value, e_completions.value, proxy.close_session("p1")

    err, err_completions, session = asyncio.run(go())
    for e in (err, err_completions):
        assert e.status_code == 400 and e.body["param"] == field and f"'{field}'" in e.body["message"]
    assert session.calls == []  # refused before the upstream: nothing recorded


def test_openai_sdk_neutral_values_pass_and_forced_fields_are_recorded(server):
    async def go():
        async with ProxyServer([server.base_url], forced_params={"temperature": 1.0}) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("p2"), api_key=proxy.api_key, max_retries=0)
            await c.chat.completions.create(
                model="gpt-x",
                messages=MESSAGES,
                max_tokens=3,
                temperature=0.2,  # forced to the recipe's 1.0
                seed=7,
                frequency_penalty=0,
                presence_penalty=0.0,
                logit_bias={},
                extra_body={"top_k": -1, "min_p": 0},
            )
            return proxy.close_session("p2")

    [call] = asyncio.run(go()).calls
    assert call.sampling == {"temperature": 1.0, "seed": 7}
    assert call.constraint is None and call.trainable


def test_anthropic_sdk_fields_are_mapped_or_refused_naming_them(server):
    anthropic = pytest.importorskip("anthropic")
    constrained_missing = missing_library()  # the server's constrained decoding (training[constrained])

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            base = f"http://127.0.0.1:{proxy.port}/sessions/a1"
            client = anthropic.AsyncAnthropic(base_url=base, api_key=proxy.api_key, max_retries=0)
            msgs = [{"role": "user", "content": "Weather in Oslo?"}]
            errors, forced = {}, {}
            for name, kwargs in {
                "top_k": {"extra_body": {"top_k": 5}},  # this SDK version has no top_k argument
                "thinking": {"thinking": {"type": "enabled", "budget_tokens": 1024}},
                "logit_bias": {"extra_body": {"logit_bias": {"1000": 100}}},
            }.items():
                with pytest.raises(anthropic.BadRequestError) as e:
                    await client.messages.create(model="claude-x", max_tokens=3, messages=msgs, **kwargs)
                errors[name] = e.value.body["error"]["message"]
            for name, choice in {"any": {"type": "any"}, "tool": {"type": "tool", "name": "get_weather"}}.items():
                kwargs = {"tools": ANTHROPIC_TOOLS, "tool_choice": choice}
                if constrained_missing:
                    with pytest.raises(anthropic.BadRequestError) as e:
                        await client.messages.create(model="claude-x", max_tokens=200, messages=msgs, **kwargs)
                    errors[name] = e.value.body["error"]["message"]
                else:
                    forced[name] = await client.messages.create(
                        model="claude-x", max_tokens=200, messages=msgs, **kwargs
                    )
            ok = await client.messages.create(
                model="claude-x",
                max_tokens=3,
                messages=msgs,
                tools=ANTHROPIC_TOOLS,
                tool_choice={"type": "auto"},
                thinking={"type": "disabled"},
                metadata={"user_id": "u1"},
                extra_body={"temperature": 1.0},
            )
            return errors, forced, ok, proxy.close_session("a1")

    errors, forced, ok, session = asyncio.run(go())
    assert "top_k" in errors["top_k"] and "thinking" in errors["thinking"] and "logit_bias" in errors["logit_bias"]
    # mapped, not ignored: "any" reaches the server as tool_choice "required" and "tool" as the named
    # function, which constrain the output to a call (or, without the library, are refused naming it)
    if constrained_missing:
        assert "llguidance" in errors["any"] and "llguidance" in errors["tool"]
    else:
        for name, reply in forced.items():
            [use] = [b for b in reply.content if b.type == "tool_use"]
            assert use.name == "get_weather" and reply.stop_reason == "tool_use", name
        forced_calls = [c for c in session.calls if c.constraint is not None]
        assert len(forced_calls) == 2 and not any(c.trainable for c in forced_calls)  # recorded and flagged
    accepted = [c for c in session.calls if c.constraint is None]
    [call] = accepted  # the refused calls were not recorded
    assert ok.usage.output_tokens == len(call.output_ids) and call.sampling == {"temperature": 1.0}


def test_openai_sdk_tool_round_trip_on_its_defaults(server, tokenizer):
    """Tools passed as the SDK passes them; the reply (tool call or not) goes back with the tool's result."""

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("t1"), api_key=proxy.api_key, max_retries=0)
            first = await c.chat.completions.create(model="gpt-x", messages=MESSAGES, tools=TOOLS, max_tokens=8, seed=5)
            reply = first.choices[0].message
            history = MESSAGES + [reply.model_dump(exclude_none=True)]
            for tc in reply.tool_calls or []:
                history.append({"role": "tool", "tool_call_id": tc.id, "content": "12 degrees"})
            if not reply.tool_calls:  # a random tiny model rarely calls: the agent asks again
                history.append({"role": "user", "content": "Call get_weather."})
            stream = await c.chat.completions.create(
                model="gpt-x", messages=history, tools=TOOLS, max_tokens=8, seed=6, stream=True
            )
            chunks = [ch async for ch in stream]
            truth = [
                await direct_chat(server, {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 8, "seed": 5}),
                await direct_chat(server, {"messages": history, "tools": TOOLS, "max_tokens": 8, "seed": 6}),
            ]
            return first, chunks, truth, proxy.close_session("t1")

    first, chunks, truth, session = asyncio.run(go())
    assert len(session.calls) == 2
    for call, t in zip(session.calls, truth):
        assert_recorded_exactly(call, t)
        prompt = tokenizer.decode(call.prompt_ids)
        assert "get_weather" in prompt and "Weather in a city, in degrees Celsius." in prompt
        assert call.tools == TOOLS
    assert first.choices[0].message.content == session.calls[0].response_message["content"]
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == (session.calls[1].response_message["content"] or "")
    assert session.calls[1].label.kind in ("APPEND", "NEW")


def test_anthropic_sdk_tool_round_trip_on_its_defaults(server, tokenizer):
    anthropic = pytest.importorskip("anthropic")

    async def go():
        async with ProxyServer([server.base_url]) as proxy:
            base = f"http://127.0.0.1:{proxy.port}/sessions/t2"
            client = anthropic.AsyncAnthropic(base_url=base, api_key=proxy.api_key, max_retries=0)
            msgs = [{"role": "user", "content": "Weather in Oslo?"}]
            first = await client.messages.create(
                model="claude-x", max_tokens=8, system="Use tools.", messages=msgs, tools=ANTHROPIC_TOOLS
            )
            blocks = [b.model_dump(exclude_none=True) for b in first.content]
            uses = [b for b in blocks if b["type"] == "tool_use"]
            follow = msgs + [{"role": "assistant", "content": blocks or [{"type": "text", "text": ""}]}]
            results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "12 degrees"} for b in uses]
            follow.append({"role": "user", "content": results or "Call get_weather."})
            async with client.messages.stream(
                model="claude-x", max_tokens=8, system="Use tools.", messages=follow, tools=ANTHROPIC_TOOLS
            ) as stream:
                streamed_text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
            return first, streamed_text, final, proxy.close_session("t2")

    first, streamed_text, final, session = asyncio.run(go())
    assert len(session.calls) == 2
    for call, message in zip(session.calls, (first, final)):
        prompt = tokenizer.decode(call.prompt_ids)
        assert "get_weather" in prompt and "Weather in a city, in degrees Celsius." in prompt
        assert message.usage.output_tokens == len(call.output_ids)
        text = "".join(b.text for b in message.content if b.type == "text")
        assert text == (call.response_message["content"] or "")
        assert [b.name for b in message.content if b.type == "tool_use"] == [
            tc["function"]["name"] for tc in call.response_message.get("tool_calls") or []
        ]
    assert streamed_text == "".join(b.text for b in final.content if b.type == "text")


def test_constrained_calls_are_flagged_and_excluded_unless_trained(server):
    """Constrained decoding is not in the engine yet, so its calls are built here: the flag and the switch."""
    assert constraint_of({"tool_choice": "auto", "response_format": {"type": "text"}}) is None
    assert constraint_of({"tool_choice": "required"}) == {"tool_choice": "required"}
    schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"}}}
    assert constraint_of({"response_format": schema}) == {"response_format": schema}
    with pytest.raises(ValueError, match="constrained_calls"):
        ProxyServer([server.base_url], constrained_calls="sometimes")

    def call(trainable_switch):
        rec = CallRecord(0, "chat", "a", [1, 2, 3], [4, 5], [-0.1, -0.2], "stop", 0, server.base_url)
        flag(rec, {"temperature": 1.0}, {"tool_choice": "required"}, trainable_switch)
        rec.label = TurnLabel("NEW", "first call", 0)
        return rec

    excluded, trained = call("exclude"), call("train")
    assert excluded.constraint == {"tool_choice": "required"} and not excluded.trainable and trained.trainable
    assert stitch_calls([excluded]).samples == []  # its output is context only: nothing to train
    [sample] = stitch_calls([trained]).samples
    assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == [4, 5]
