"""Proxy behaviour that the tiny model cannot trigger on demand, against a scripted upstream:
structured tool calls, 5xx retries, a refused ``max_tokens``, missing token detail, closed
sessions, auth."""

import asyncio
import json

import openai
import pytest
from aiohttp import web

from training.proxy import ProxyServer, make_proxy_rollout_fn, with_tool_status
from training.proxy.rollout import UpstreamFailedError
from training.utils.rl.rollout import RolloutSetup


class ScriptedUpstream:
    """An OpenAI-shaped upstream; ``script`` lists the next replies: ok (a tool call), text, 500, 400max, bare."""

    def __init__(self):
        self.script: list[str] = []
        self.bodies: list[dict] = []
        self.runner = None

    async def handle(self, request):
        body = await request.json()
        self.bodies.append(body)
        kind = self.script.pop(0) if self.script else "ok"
        if kind == "500":
            return web.json_response({"error": {"message": "boom"}}, status=503)
        if kind == "400max":
            return web.json_response(
                {"error": {"message": "'max_tokens'=999 plus the prompt exceeds max_model_len", "param": "max_tokens"}},
                status=400,
            )
        call = {
            "id": "call_abc",
            "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": "2+3"})},
        }
        message = (
            {"role": "assistant", "content": "5", "tool_calls": []}
            if kind == "text"
            else {"role": "assistant", "content": None, "tool_calls": [call]}
        )
        choice = {
            "index": 0,
            "finish_reason": "stop" if kind == "text" else "tool_calls",
            "weight_version": 3,
            "message": message,
            "logprobs": {"content": [{"token": "x", "logprob": -0.5, "bytes": [120], "top_logprobs": []}] * 3},
        }
        if kind != "bare":
            choice.update(token_ids=[5, 6, 7], prompt_token_ids=[1, 2, 3, 4])
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "tiny",
                "choices": [choice],
                "usage": {"prompt_tokens": 4, "completion_tokens": 3, "total_tokens": 7},
                "weight_version": 3,
            }
        )

    async def __aenter__(self):
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self.handle)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc):
        await self.runner.cleanup()


def chat(proxy, sid, **kw):
    c = openai.AsyncOpenAI(base_url=proxy.session_url(sid), api_key=proxy.api_key, max_retries=0)
    return c.chat.completions.create(model="gpt-x", messages=[{"role": "user", "content": "2+3"}], **kw)


def test_tool_calls_come_back_structured_and_token_fields_stripped():
    async def go():
        async with ScriptedUpstream() as up, ProxyServer([up.url], backoff_s=0.01) as proxy:
            r = await chat(
                proxy, "t", tools=[{"type": "function", "function": {"name": "calculator"}}], temperature=0.3
            )
            return r, up.bodies[0], proxy.close_session("t")

    r, forwarded, session = asyncio.run(go())
    [tc] = r.choices[0].message.tool_calls
    assert (tc.function.name, json.loads(tc.function.arguments), r.choices[0].finish_reason) == (
        "calculator",
        {"expression": "2+3"},
        "tool_calls",
    )
    assert "token_ids" not in (r.choices[0].model_extra or {}) and r.choices[0].logprobs is None
    assert forwarded["return_token_ids"] is True and forwarded["logprobs"] is True and "model" not in forwarded
    [c] = session.calls
    assert (c.prompt_ids, c.output_ids, c.output_logprobs, c.weight_version) == ([1, 2, 3, 4], [5, 6, 7], [-0.5] * 3, 3)
    assert c.response_message["tool_calls"][0]["function"]["name"] == "calculator"


def test_upstream_5xx_is_retried_then_fails_the_sample():
    async def swallowing_agent(row, ep):
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        try:
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        except openai.APIStatusError as e:
            assert e.status_code == 502
        return "whatever"

    async def go():
        async with ScriptedUpstream() as up:
            up.script = ["500", "500", "ok"]  # two failures, then success: within 3 retries
            async with ProxyServer([up.url], backoff_s=0.01) as proxy:
                await chat(proxy, "r")
                assert len(up.bodies) == 3 and len(proxy.sessions["r"].calls) == 1
            up.script = ["500"] * 10

            class Sampler:
                base_url, api_key = up.url, None

            setup = RolloutSetup(
                sampler=Sampler(), tokenizer=None, sampling_kwargs={"temperature": 0.7, "max_tokens": 9}
            )
            fn = make_proxy_rollout_fn(
                swallowing_agent, reward_fn=lambda r, a: 1.0, proxy_kwargs={"backoff_s": 0.01, "max_retries": 2}
            )(setup)
            with pytest.raises(UpstreamFailedError, match="failed after 3 attempts: HTTP 503"):
                await fn({})
            return up.bodies[-1]

    forwarded = asyncio.run(go())
    assert forwarded["temperature"] == 0.7 and forwarded["max_tokens"] == 9  # recipe's sampling forced / defaulted


def test_refused_max_tokens_is_the_agents_400_and_never_retried_without_it():
    async def go():
        async with ScriptedUpstream() as up, ProxyServer([up.url]) as proxy:
            up.script = ["400max", "ok"]
            with pytest.raises(openai.BadRequestError, match="exceeds max_model_len") as e:
                await chat(proxy, "o", max_tokens=999)
            return e.value.body, up.bodies, proxy.close_session("o")

    error, bodies, session = asyncio.run(go())
    assert error["param"] == "max_tokens"
    assert len(bodies) == 1 and bodies[0]["max_tokens"] == 999  # one upstream call: no retry without the field
    assert session.calls == []


def test_missing_token_detail_closed_session_auth_and_responses_api_are_clear_errors():
    async def go():
        async with ScriptedUpstream() as up, ProxyServer([up.url]) as proxy:
            up.script = ["bare"]
            with pytest.raises(openai.APIStatusError, match="lacks token-level detail") as e:
                await chat(proxy, "b")
            assert e.value.status_code == 502
            proxy.close_session("b")
            with pytest.raises(openai.APIStatusError, match="is closed") as e:
                await chat(proxy, "b")
            assert e.value.status_code == 410
            c = openai.AsyncOpenAI(base_url=proxy.session_url("s"), api_key=proxy.api_key, max_retries=0)
            with pytest.raises(openai.NotFoundError, match="not found in this session"):  # the Responses API is served
                await c.responses.create(model="m", input="hi", previous_response_id="resp_elsewhere")
            bad = openai.AsyncOpenAI(base_url=proxy.session_url("x"), api_key="wrong", max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await bad.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
            anon = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=proxy.api_key, max_retries=0)
            with pytest.raises(openai.BadRequestError, match="x-multi-turn-session-id"):
                await anon.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])

    asyncio.run(go())


def test_tool_status_credit_penalises_failed_tool_calls_through_the_proxy():
    async def agent(row, ep):
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        msgs = [{"role": "user", "content": "2+3"}]
        r = await c.chat.completions.create(model="m", messages=msgs)
        msg = r.choices[0].message
        msgs += [
            msg.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "error: division by zero"},
        ]
        await c.chat.completions.create(model="m", messages=msgs)
        return "5"

    async def go():
        async with ScriptedUpstream() as up:
            up.script = ["ok", "text"]

            class Sampler:
                base_url, api_key = up.url, None

            setup = RolloutSetup(sampler=Sampler(), tokenizer=None, sampling_kwargs={})
            fn = make_proxy_rollout_fn(
                agent, reward_fn=lambda r, a: 1.0, mode="transitions", credit_fn=with_tool_status(failed_call=-0.5)
            )(setup)
            return await fn({})

    run = asyncio.run(go())
    assert run.metadata["credited_rewards"] == [0.5, 1.0]  # the first call's tool call failed; the answer did not


class FakeSupervisorView:
    """A FAKE of the recipe sampler's restart rules (``wait_ready``, ``resend_after_restart``): a replica that
    dies under the next ``deaths`` calls and comes back, or one that is ``lost``. A real kill is
    tests/recipes/test_fault_matrix.py's proxy test."""

    api_key = None

    def __init__(self, url, deaths=0, lost=None):
        self.base_url, self.deaths, self.lost, self.waits = url, deaths, lost, 0

    async def wait_ready(self, url):
        self.waits += 1
        if self.lost is not None:
            raise self.lost

    def resend_after_restart(self, url):
        self.deaths -= 1
        return self.deaths >= 0


def test_proxy_calls_resend_after_a_restart_requeue_on_a_deployment_failure_and_stop_on_a_lost_server():
    from training.deployment.client import DeploymentLostError
    from training.recipes.context import is_fatal, is_retryable

    async def agent(row, ep):
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3"}])
        return "5"

    async def episode(up, script, view):
        up.script = list(script)
        setup = RolloutSetup(sampler=view, tokenizer=None, sampling_kwargs={})
        fn = make_proxy_rollout_fn(agent, reward_fn=lambda r, a: 1.0, proxy_kwargs={"backoff_s": 0.01})(setup)
        try:
            return await fn({})
        except Exception as e:  # noqa: BLE001 - the test inspects what the recipe would see
            return e
        finally:
            await fn.close()

    async def go():
        async with ScriptedUpstream() as up:
            view = FakeSupervisorView(up.url, deaths=2)
            resent = await episode(up, ["500", "500", "ok"], view)  # died twice under the call: two resends, no retry
            resent_bodies, resent_waits = len(up.bodies), view.waits
            failed = await episode(up, ["500"] * 10, FakeSupervisorView(up.url))
            bare = await episode(up, ["bare"], FakeSupervisorView(up.url))
            lost = await episode(up, ["ok"], FakeSupervisorView(up.url, lost=DeploymentLostError("restarts spent")))
            return resent, resent_bodies, resent_waits, failed, bare, lost

    resent, resent_bodies, resent_waits, failed, bare, lost = asyncio.run(go())
    assert resent.reward == 1.0 and resent_bodies == 3 and resent_waits == 3  # waited before each of the 3 sends
    assert isinstance(failed, UpstreamFailedError) and failed.deployment_failure and is_retryable(failed)
    assert "failed after 4 attempts: HTTP 503" in str(failed)
    assert isinstance(bare, UpstreamFailedError) and not bare.deployment_failure and not is_retryable(bare)
    assert isinstance(lost, DeploymentLostError) and is_fatal(lost) and lost.reason == "restarts spent"


def test_a_proxy_episode_in_a_completion_scope_sends_the_same_derived_seeds_every_time():
    """The recipe runs each completion in a ``seed_scope`` (``request_seeds.py``): the proxy stamps the episode's calls
    that name no seed from it, so a resent call, a requeued row and a resumed run draw the same tokens; an agent's own
    seed is kept, and outside any scope nothing is added."""
    from training.utils.rl.request_seeds import seed_scope

    async def agent(row, ep):
        c = openai.AsyncOpenAI(base_url=ep.base_url, api_key=ep.api_key, max_retries=0)
        for seed in (None, 7, None):
            extra = {} if seed is None else {"seed": seed}
            await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "2+3"}], **extra)
        return "5"

    async def go():
        async with ScriptedUpstream() as up:
            up.script = ["text"] * 12

            class Sampler:
                base_url, api_key = up.url, None

            fn = make_proxy_rollout_fn(agent, reward_fn=lambda r, a: 1.0)(
                RolloutSetup(sampler=Sampler(), tokenizer=None)
            )
            try:
                for key in ((0, 0, 3, 1), (0, 0, 3, 1), (0, 0, 3, 2)):  # (run seed, version, position, completion)
                    with seed_scope(*key):
                        await fn({})
                await fn({})
            finally:
                await fn.close()
            return [b.get("seed") for b in up.bodies]

    seeds = asyncio.run(go())
    first, again, other, unscoped = seeds[0:3], seeds[3:6], seeds[6:9], seeds[9:12]
    assert first == again and first[1] == 7 and None not in first and first[0] != first[2]
    assert other[1] == 7 and {other[0], other[2]}.isdisjoint({first[0], first[2]})
    assert unscoped == [None, 7, None]
