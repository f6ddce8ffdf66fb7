"""Every bad request gets a 4xx, per-session keys, a bounded session table: the real proxy in front of the
real deployment server (tiny model), over loopback."""

import asyncio
import gzip
import http.client
import json
import threading
import zlib

import aiohttp
import openai
import pytest

from training.proxy import ProxyServer, make_proxy_rollout_fn
from training.utils.http import auth_headers
from training.utils.rl.rollout import RolloutSetup

MESSAGES = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_batch_size=8)


def proxy_for(server, **kw) -> ProxyServer:
    return ProxyServer([server.base_url], upstream_api_key=server.api_key, **kw)


async def post(url: str, data: bytes, headers: dict) -> tuple[int, dict]:
    """One POST on a fresh connection (a body the server refuses may end the connection)."""
    async with aiohttp.ClientSession(auto_decompress=False) as s:
        async with s.post(url, data=data, headers={"Content-Type": "application/json", **headers}) as r:
            return r.status, await r.json(content_type=None)


def chat_body(model: str = "m", **kw) -> bytes:
    return json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 2, **kw}).encode()


@pytest.mark.parametrize("bad", [-1, "abc", 1.5])
def test_invalid_max_tokens_is_the_agents_400_not_a_generation_to_the_context_end(server, bad):
    async def go():
        async with proxy_for(server) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("mt"), api_key=proxy.api_key, max_retries=0)
            for stream in (False, True):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=bad, stream=stream)
                assert e.value.body["param"] == "max_tokens"
            return proxy.close_session("mt")

    assert asyncio.run(go()).calls == []  # nothing generated, nothing recorded


@pytest.mark.parametrize("raw_sid", ["sess-\u00e9\u4e2d".encode(), "s\xe9ss\xeeon".encode("latin-1")])
def test_non_ascii_session_header_is_a_400_naming_the_header(server, raw_sid):
    def raw_post(port: int) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        conn.request(
            "POST",
            "/v1/chat/completions",
            chat_body(),
            {"x-multi-turn-session-id": raw_sid, "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())

    async def go():
        async with ProxyServer([server.base_url], upstream_api_key=server.api_key, api_key=None) as proxy:
            return await asyncio.to_thread(raw_post, proxy.port)

    status, body = asyncio.run(go())
    assert status == 400
    assert "'x-multi-turn-session-id' header" in body["error"]["message"]
    assert "printable ASCII" in body["error"]["message"]


@pytest.mark.parametrize("target", ["proxy", "server"])
def test_content_encoding_gzip_deflate_decoded_bad_ones_400_unknown_415(server, target):
    async def go():
        async with proxy_for(server) as proxy:
            if target == "proxy":
                url, key = f"{proxy.session_url('enc')}/chat/completions", proxy.api_key
            else:
                url, key = f"{server.base_url.rstrip('/')}/v1/chat/completions", server.api_key
            h, body = auth_headers(key), chat_body(server.served_model_name)
            results = {
                "gzip": await post(url, gzip.compress(body), {**h, "Content-Encoding": "gzip"}),
                "deflate": await post(url, zlib.compress(body), {**h, "Content-Encoding": "deflate"}),
                "bad gzip": await post(url, body, {**h, "Content-Encoding": "gzip"}),
                "bad deflate": await post(url, b"not deflate at all" * 10, {**h, "Content-Encoding": "deflate"}),
                "unknown": await post(url, body, {**h, "Content-Encoding": "zstd-or-whatever"}),
                "stacked": await post(url, body, {**h, "Content-Encoding": "gzip, deflate"}),
            }
            return results

    r = asyncio.run(go())
    assert r["gzip"][0] == 200 and r["gzip"][1]["choices"]
    assert r["deflate"][0] == 200 and r["deflate"][1]["choices"]
    for name in ("bad gzip", "bad deflate"):
        assert r[name][0] == 400, (name, r[name])
    assert r["bad gzip"][1]["error"]["message"].startswith("the request body is not valid gzip data")
    for name in ("unknown", "stacked"):
        assert r[name][0] == 415, (name, r[name])
        assert "Content-Encoding" in r[name][1]["error"]["message"]


def test_large_json_bodies_are_parsed_off_the_event_loop(server, monkeypatch):
    import training.utils.http as request_body

    threads: list[tuple[int, bool]] = []
    parse = request_body.parse_json_body

    def spying_parse(raw):
        threads.append((len(raw), threading.current_thread() is threading.main_thread()))
        return parse(raw)

    monkeypatch.setattr(request_body, "parse_json_body", spying_parse)

    async def go():
        async with proxy_for(server) as proxy:
            url = f"{proxy.session_url('big')}/chat/completions"
            small = await post(url, chat_body(), auth_headers(proxy.api_key))
            big = await post(url, chat_body(padding=[0] * 1_000_000), auth_headers(proxy.api_key))
            return small, big

    small, big = asyncio.run(go())
    assert small[0] == 200 and big[0] == 400, big  # the upstream refuses the unknown field: its 4xx passes through
    assert big[1]["error"]["param"] == "padding"
    (small_len, small_on_loop), (big_len, big_on_loop) = threads
    assert small_len < request_body.OFFLOAD_JSON_BYTES < big_len
    assert small_on_loop and not big_on_loop


def test_tools_beyond_the_configured_limits_are_a_400_naming_the_limit(server):
    def tool(i: int, description: str = "a tool") -> dict:
        return {"type": "function", "function": {"name": f"t{i}", "description": description, "parameters": {}}}

    async def go():
        async with proxy_for(server) as proxy:
            c = openai.AsyncOpenAI(base_url=proxy.session_url("tools"), api_key=proxy.api_key, max_retries=0)
            errors = []
            for tools in ([tool(i) for i in range(129)], [tool(0, "x" * 600_000), tool(1, "y" * 600_000)]):
                with pytest.raises(openai.BadRequestError) as e:
                    await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2, tools=tools)
                errors.append(e.value.body)
            return errors

    count, size = asyncio.run(go())
    assert count["param"] == "tools" and "max_tools=128" in count["message"]
    assert size["param"] == "tools" and "max_tools_bytes=1048576" in size["message"]


def test_a_session_key_cannot_pause_read_or_reward_another_session(server):
    from training.proxy.access import session_key

    async def go():
        async with proxy_for(server) as proxy:
            key_a = proxy.session_key("a")
            assert key_a != proxy.api_key and key_a == session_key(proxy.api_key, "a")
            own = openai.AsyncOpenAI(base_url=proxy.session_url("a"), api_key=key_a, max_retries=0)
            await own.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            plain = openai.AsyncOpenAI(base_url=proxy.base_url, api_key=key_a, max_retries=0)
            await plain.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)  # the key names "a"
            control = openai.AsyncOpenAI(base_url=proxy.session_url("b"), api_key=proxy.api_key, max_retries=0)
            await control.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            base = f"http://127.0.0.1:{proxy.port}"
            got = {}
            async with aiohttp.ClientSession(headers=auth_headers(key_a)) as s:
                for name, method, path, body in [
                    ("pause", "POST", "/proxy/pause", None),
                    ("resume", "POST", "/proxy/resume", None),
                    ("calls of b", "GET", "/sessions/b/calls", None),
                    ("reward b", "POST", "/sessions/b/reward", {"reward": 1.0}),
                    ("reward b by header", "POST", "/proxy/reward", {"reward": 1.0}),
                    ("call as b", "POST", "/sessions/b/v1/chat/completions", json.loads(chat_body())),
                    ("own calls", "GET", "/sessions/a/calls", None),
                    ("own reward", "POST", "/sessions/a/reward", {"reward": 0.5}),
                ]:
                    headers = {"x-multi-turn-session-id": "b"} if "header" in name else {}
                    async with s.request(method, base + path, json=body, headers=headers) as r:
                        got[name] = (r.status, await r.json())
            async with aiohttp.ClientSession(headers=auth_headers("sk-session-YQ.forged")) as s:
                async with s.get(base + "/sessions/a/calls") as r:
                    got["forged"] = r.status
            assert not proxy.gate.paused
            return got, proxy.close_session("a"), proxy.close_session("b")

    got, a, b = asyncio.run(go())
    for name in ("pause", "resume", "calls of b", "reward b", "reward b by header", "call as b"):
        assert got[name][0] == 403, (name, got[name])
        assert got[name][1]["error"]["type"] == "permission_error"
    assert "control key" in got["pause"][1]["error"]["message"]
    assert got["own calls"][0] == 200 and len(got["own calls"][1]["calls"]) == 2
    assert got["own reward"][0] == 200
    assert got["forged"] == 401
    assert len(a.calls) == 2 and a.calls[-1].posted_rewards == [0.5]
    assert len(b.calls) == 1 and b.calls[0].posted_rewards == []


def test_the_rollout_hands_each_agent_its_own_session_key(server):
    from training.proxy.access import session_key

    seen = []

    async def agent(row, endpoint):
        seen.append(endpoint)
        c = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
        await c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
        async with aiohttp.ClientSession(headers=auth_headers(endpoint.api_key)) as s:
            async with s.post(endpoint.base_url.split("/sessions/")[0] + "/proxy/pause") as r:
                return r.status

    class Sampler:
        base_url, api_key = server.base_url, server.api_key

    setup = RolloutSetup(sampler=Sampler(), tokenizer=None, sampling_kwargs={"temperature": 1.0, "max_tokens": 2})

    async def go():
        fn = make_proxy_rollout_fn(agent, reward_fn=lambda row, answer: float(answer == 403), template_check="off")(
            setup
        )
        runs = [await fn({}), await fn({})]
        return runs, fn.proxy

    runs, proxy = asyncio.run(go())
    assert [r.reward for r in runs] == [1.0, 1.0]  # each agent's pause was refused
    assert seen[0].api_key == session_key(proxy.api_key, seen[0].session_id) != proxy.api_key
    assert seen[0].api_key != seen[1].api_key


def test_sessions_are_bounded_and_one_with_a_call_in_flight_is_never_evicted(server):
    async def go():
        async with proxy_for(server, max_sessions=2) as proxy:
            await proxy.gate.pause_and_drain()  # the held call waits at the gate, in flight for its session
            c = openai.AsyncOpenAI(base_url=proxy.session_url("held"), api_key=proxy.api_key, max_retries=0)
            held = asyncio.ensure_future(c.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2))
            while "held" not in proxy.sessions or proxy.sessions["held"].in_flight == 0:
                await asyncio.sleep(0.01)
            for sid in ("s1", "s2", "s3"):
                proxy.open_session(sid)
            assert set(proxy.sessions) == {"held", "s3"}
            async with aiohttp.ClientSession() as s, s.get(f"http://127.0.0.1:{proxy.port}/health") as r:
                health = await r.json()
            proxy.gate.resume()
            reply = await held
            late = openai.AsyncOpenAI(base_url=proxy.session_url("s1"), api_key=proxy.api_key, max_retries=0)
            with pytest.raises(openai.APIStatusError, match="max_sessions=2") as e:
                await late.chat.completions.create(model="m", messages=MESSAGES, max_tokens=2)
            return health, reply, e.value.status_code, proxy.close_session("s1"), proxy.close_session("held")

    health, reply, late_status, s1, held = asyncio.run(go())
    assert health["sessions"] == 2 and health["max_sessions"] == 2 and health["sessions_evicted"] == 2
    assert reply.choices and len(held.calls) == 1
    assert late_status == 410 and "evicted" in s1.evicted


def test_idle_sessions_expire(server):
    async def go():
        async with proxy_for(server, session_idle_s=0.05) as proxy:
            proxy.open_session("old")
            await asyncio.sleep(0.2)
            proxy.open_session("new")
            return set(proxy.sessions), proxy.close_session("old")

    open_ids, old = asyncio.run(go())
    assert open_ids == {"new"}
    assert old.evicted.startswith("expired: no activity for more than 0.05 s")
