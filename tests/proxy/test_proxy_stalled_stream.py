"""No agent can stall a sync: a stream the agent stops reading is aborted within ``stream_write_timeout_s``, the
pre-sync drain cancels stragglers after ``drain_timeout_s`` (both deadlines a recipe's ``Config.proxy``), counted per
step in ``rollout/drain_cancelled_calls``, and another session's call never waits (real tiny server)."""

import asyncio
import json
import socket
import time
from urllib.parse import urlsplit

import openai
import pytest

from training.deployment.client import DeploymentSampler
from training.proxy import make_proxy_rollout_fn
from training.proxy.rollout import AgentFailedError
from training.utils.config import ProxyConfig
from training.utils.rl.rollout import RolloutSetup

MESSAGES = [{"role": "user", "content": "Count from one to one thousand."}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8, max_model_len=512)


def long_stream_request(endpoint) -> bytes:
    """A streamed chat call asking for a long, fat reply: 400 tokens, each chunk echoing a 32 kB ``model`` name
    (about 13 MB in all, more than the proxy's socket buffers hold, so its writes wait for the agent)."""
    url = urlsplit(endpoint.base_url)
    body = json.dumps(
        {
            "model": "m" * 32768,
            "messages": MESSAGES,
            "stream": True,
            "max_tokens": 400,
            "ignore_eos": True,
            "logprobs": True,
            "top_logprobs": 20,
            "return_token_ids": True,
        }
    ).encode()
    head = (
        f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {endpoint.api_key}\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def stalled_agent(endpoint, released: asyncio.Event) -> str:
    """Sends the request, reads nothing until ``released``, then reads what is left (the agent swallows any error)."""
    url = urlsplit(endpoint.base_url)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)  # before connect: a small window fills fast
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    try:
        await loop.sock_connect(sock, (url.hostname, url.port))
        await loop.sock_sendall(sock, long_stream_request(endpoint))
        await released.wait()
        data = b""
        while True:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
            except (ConnectionError, asyncio.TimeoutError):
                break
            if not chunk:
                break
            data += chunk
        return "done" if b"[DONE]" in data else "broken"
    finally:
        sock.close()


async def quick_agent(endpoint) -> str:
    async with openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0) as c:
        r = await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    return r.choices[0].message.content


async def wait_for(cond, timeout_s: float) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout_s, "timed out"
        await asyncio.sleep(0.05)
    return time.monotonic() - t0


def make_rollout_fn(server, agent, proxy_config=None, **proxy_kwargs):
    sampler = DeploymentSampler(server.base_url)
    setup = RolloutSetup(
        sampler=sampler, tokenizer=None, sampling_kwargs={"temperature": 1.0}, proxy_config=proxy_config
    )
    make = make_proxy_rollout_fn(
        agent, reward_fn=lambda row, result: 1.0, template_check="off", proxy_kwargs=proxy_kwargs
    )
    return make(setup), sampler


def test_a_stream_the_agent_stops_reading_is_aborted_and_never_stalls_another_session(server):
    async def go():
        released = asyncio.Event()

        async def agent(row, endpoint):
            return await (stalled_agent(endpoint, released) if row["who"] == "A" else quick_agent(endpoint))

        fn, sampler = make_rollout_fn(server, agent, stream_write_timeout_s=1.0, upstream_stream="on")
        try:
            proxy = await fn.ensure_started()
            a = asyncio.create_task(fn({"who": "A"}))
            await wait_for(lambda: proxy.gate.in_flight == 1, 10)
            t0 = time.monotonic()
            run_b = await asyncio.wait_for(fn({"who": "B"}), 10)  # B's call completes while A's stream is stuck
            b_s = time.monotonic() - t0
            abort_s = await wait_for(lambda: proxy.aborted_streams == 1, 15)
            assert proxy.gate.in_flight == 0  # the aborted call released its in-flight count
            released.set()
            with pytest.raises(AgentFailedError, match="stream aborted") as err:
                await asyncio.wait_for(a, 15)
            assert err.value.failure_cause == "call_aborted"  # the episode fails: nothing of it is trained
            return run_b, b_s, abort_s, (await proxy_health(proxy))
        finally:
            await fn.close()
            await sampler.close()

    run_b, b_s, abort_s, health = asyncio.run(go())
    assert run_b is not None and len(run_b.samples()) == 1 and b_s < 10
    assert abort_s < 15 and health["aborted_streams"] == 1 and health["in_flight"] == 0


async def proxy_health(proxy) -> dict:
    from aiohttp import ClientSession

    async with ClientSession() as s:
        async with s.get(
            f"http://{proxy.host}:{proxy.port}/health", headers={"Authorization": f"Bearer {proxy.api_key}"}
        ) as r:
            return await r.json()


def step_metric(fn, sampler) -> float:
    """``rollout/drain_cancelled_calls`` as ``RunContext.take_counters`` reports it for a step (the real method on
    the few parts of a run context it reads)."""
    from types import SimpleNamespace

    from training.recipes.context import RunContext
    from training.recipes.step_metrics import StepCounters
    from training.utils.rl.failure_log import FailureLog

    ctx = SimpleNamespace(
        counters=StepCounters(),
        deployment=SimpleNamespace(sampler=sampler),
        rollout_fn=fn,
        _sampler_seen={},
        failure_log=FailureLog("rollout"),
        cfg=SimpleNamespace(group_reward_fn=None),
    )
    return RunContext.take_counters(ctx)["rollout/drain_cancelled_calls"]


def test_the_pre_sync_drain_cancels_a_straggler_after_its_deadline_and_the_sync_proceeds(server):
    async def go():
        released = asyncio.Event()

        async def agent(row, endpoint):
            return await (stalled_agent(endpoint, released) if row["who"] == "A" else quick_agent(endpoint))

        deadlines = ProxyConfig(stream_write_timeout_s=60.0, drain_timeout_s=1.5)  # a recipe's Config.proxy
        fn, sampler = make_rollout_fn(server, agent, proxy_config=deadlines, upstream_stream="on")
        try:
            proxy = await fn.ensure_started()
            assert (proxy.stream_write_timeout_s, proxy.drain_timeout_s) == (60.0, 1.5)
            a = asyncio.create_task(fn({"who": "A"}))
            await wait_for(lambda: proxy.gate.in_flight == 1, 10)
            await asyncio.sleep(1.0)  # the stream is stuck on the agent's full window
            run_b = await asyncio.wait_for(fn({"who": "B"}), 10)  # another session never waits on A's socket
            assert run_b is not None and proxy.gate.in_flight == 1 and proxy.aborted_streams == 0  # A still stuck
            t0 = time.monotonic()
            await fn.before_weight_sync()  # what DeploymentGroup.push runs first
            drain_s = time.monotonic() - t0
            assert proxy.drain_cancelled_calls == 1 and proxy.gate.in_flight == 0 and proxy.aborted_streams == 0
            assert step_metric(fn, sampler) == 1.0  # the recipe's rollout/drain_cancelled_calls of this step
            await fn.after_weight_sync()
            assert not proxy.gate.paused
            released.set()
            with pytest.raises(AgentFailedError, match="pre-sync drain") as err:
                await asyncio.wait_for(a, 15)
            assert err.value.failure_cause == "call_aborted"
            return drain_s
        finally:
            await fn.close()
            await sampler.close()

    drain_s = asyncio.run(go())
    assert 1.4 < drain_s < 1.5 + 5.0  # the deadline, plus the cancelled call's unwinding
