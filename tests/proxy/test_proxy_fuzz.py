"""Seeded fuzzing of the recording proxy (``training/proxy``) over a real server: every bad request is a 4xx.

The quick test (in the suite) sends a few hundred requests in batches to every route an agent can
reach: the OpenAI and Anthropic generation routes (plain and under ``/sessions/{id}``), rewards,
a session's calls, the models list and the control routes. Each request carries one of several
credentials (the control key, a session's own key, another session's key, a junk key, none) and
sometimes an odd ``Content-Encoding``; some send odd raw headers or disconnect mid-body. After
every batch the canary (a greedy call through the proxy) must answer exactly as it did before.
No answer may be a 5xx and none may take over 30 s. The long fuzzes (``slow``) send eight times as
many of the same mix, and the generic malformations with the control key. Bodies come from ``tests/deployment/test_fuzz.py``.
"""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from training.proxy import ProxyServer
from tests.deployment.test_fuzz import API_KEY, _body, _extreme_body, _fuzz, _greedy, _weird_values

QUICK_BATCHES = 5
QUICK_BATCH_REQUESTS = 60
LONG_BATCHES = 40
PROXY_REQUESTS = 500
SESSIONS = ["agent-a", "agent-b", "agent-c"]
"""The sessions the quick fuzz's agents use (a few: the session table's bound is not what this tests)."""

ODD_RAW_HEADERS = [
    "x-multi-turn-session-id: s\xe9ss\xeeon\r\n".encode("latin-1"),
    b"x-multi-turn-session-id: " + b"s" * 20000 + b"\r\n",
    "x-session-affinity: \u2603\r\n".encode("utf-8"),
    b"x-multi-turn-session-id: \r\n",
    b"x-multi-turn-session-id: a\x01b\r\n",
    b"Content-Encoding: gzip\r\n",
    b"Transfer-Encoding: chunked\r\n",
]

QUICK_PATHS = [
    "/v1/chat/completions",
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/responses",
    "/sessions/agent-a/v1/chat/completions",
    "/sessions/agent-b/v1/completions",
    "/sessions/\u2603/v1/completions",
    "/sessions/agent-a/reward",
    "/proxy/reward",
    "/proxy/pause",
    "/proxy/resume",
    "GET /sessions/agent-a/calls",
    "GET /sessions/agent-c/calls",
    "GET /sessions/no-such-session/calls",
    "GET /v1/models",
    "GET /health",
]


def _agent_headers(proxy: ProxyServer):
    """Per request: one of the credentials an agent (or an attacker) may hold, and sometimes an odd encoding.

    The control key never goes to ``/proxy/pause``: it would legitimately hold every later call (the recipe
    resumes after its push); ``/proxy/resume`` with it is a 409 (nothing to resume)."""

    def make(rng: random.Random, path: str) -> dict:
        own = rng.choice(SESSIONS)
        other = rng.choice([s for s in SESSIONS if s != own])
        key = rng.choice(
            [
                proxy.api_key,
                proxy.session_key(own),
                proxy.session_key(own),
                proxy.session_key(other),
                "sk-session-junk.0000",
                "x" * rng.choice([1, 5000]),
                None,
            ]
        )
        if path == "/proxy/pause" and key == proxy.api_key:
            key = proxy.session_key(own)
        headers = {"x-multi-turn-session-id": own}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        if rng.random() < 0.1:
            headers["Content-Encoding"] = rng.choice(["gzip", "deflate", "br", "identity", "zstd", "x-nonsense"])
        return headers

    return make


def _raw_auth(proxy: ProxyServer):
    """The ``Authorization`` of the raw odd-header requests: the control key (past the key check, so the odd
    session header is what gets judged), except on ``/proxy/pause``, where it would hold every later call."""
    return lambda path: f"Bearer {proxy.session_key('agent-a') if path == '/proxy/pause' else proxy.api_key}"


def _proxy_body(rng: random.Random, path: str) -> bytes:
    """A fuzzed body for ``path``: generic malformations and extreme values for generation routes, odd
    rewards for the reward routes (an empty body for the control routes, now and then a junk one)."""
    if path.endswith("/reward"):
        body = {"reward": rng.choice(_weird_values(rng) + [1.0, 0.5, 1e200, -1e300])}
        if rng.random() < 0.5:
            body["call"] = rng.choice([0, 1, -1, 2**63, "0", None, 0.0, True])
        if rng.random() < 0.2:
            body["user"] = rng.choice(SESSIONS + ["\x00", "é" * 300])
        return json.dumps(body).encode("utf-8", "surrogatepass")
    if path.startswith("/proxy/"):
        return b"" if rng.random() < 0.7 else _body(rng, chat=False)
    if path.endswith("/v1/messages"):
        body = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        for _ in range(rng.randrange(0, 3)):
            body[
                rng.choice(["max_tokens", "messages", "system", "tools", "tool_choice", "stop_sequences", "stream"])
            ] = rng.choice(_weird_values(rng))
        return json.dumps(body).encode("utf-8", "surrogatepass")
    chat = "chat" in path or "responses" in path
    return _body(rng, chat) if rng.random() < 0.7 else json.dumps(_extreme_body(rng, chat)).encode()


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(
        api_key=API_KEY, max_batch_size=16, max_model_len=256
    )  # the fuzz reaches it through the proxy


def _agent_fuzz(server, batches: int, per_batch: int, seed: int) -> dict[int, int]:
    """``batches`` × ``per_batch`` requests of the agent mix through a fresh proxy; after every batch the greedy
    canary through the proxy answers as the server does directly and the proxy is not left paused. Asserts no
    5xx and no answer over 30 s; returns the count of each status."""
    direct = asyncio.run(_greedy(server.base_url, "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}))

    async def go():
        async with ProxyServer([server.base_url], upstream_api_key=API_KEY) as proxy:
            root = proxy.base_url.removesuffix("/v1")
            canary_headers = {"Authorization": f"Bearer {proxy.api_key}", "x-multi-turn-session-id": "canary"}
            assert await _greedy(root, "/v1/completions", canary_headers) == direct, "before the first batch"
            statuses: dict[int, int] = {}
            for batch in range(batches):
                out = await _fuzz(
                    root,
                    QUICK_PATHS,
                    per_batch,
                    seed=seed + batch,
                    headers={},
                    extra_headers=ODD_RAW_HEADERS,
                    make_body=_proxy_body,
                    timeout_s=30.0,
                    make_headers=_agent_headers(proxy),
                    odd_header_every=10,
                    odd_header_auth=_raw_auth(proxy),
                )
                assert out["failures"] == [], f"batch {batch}:\n" + "\n".join(out["failures"][:20])
                for code, count in out["statuses"].items():
                    statuses[code] = statuses.get(code, 0) + count
                assert await _greedy(root, "/v1/completions", canary_headers) == direct, f"after batch {batch}"
                assert not proxy.gate.paused, f"batch {batch} left the proxy paused"
            return statuses

    statuses = asyncio.run(go())
    assert sum(statuses.values()) >= batches * per_batch * 0.9, statuses
    for code in (200, 400, 401, 403):  # the fuzz reaches generation, validation and both access checks
        assert statuses.get(code, 0) > 0, statuses
    return statuses


def test_quick_proxy_fuzz_is_all_4xx_or_2xx_and_the_canary_never_changes(server):
    """A few hundred seeded odd requests, in batches, with agents' and attackers' credentials; the greedy
    canary through the proxy answers identically before and after every batch (and as the server does
    directly), no answer is a 5xx and none takes over 30 s."""
    _agent_fuzz(server, QUICK_BATCHES, QUICK_BATCH_REQUESTS, seed=777)


@pytest.mark.slow
def test_long_proxy_fuzz_of_the_agent_mix(server):
    _agent_fuzz(server, LONG_BATCHES, QUICK_BATCH_REQUESTS, seed=5000)


@pytest.mark.slow
def test_proxy_answers_every_fuzzed_request_below_500_and_still_serves(server):
    async def go():
        async with ProxyServer([server.base_url], upstream_api_key=API_KEY) as proxy:
            headers = {"Authorization": f"Bearer {proxy.api_key}", "x-multi-turn-session-id": "fuzz"}
            root = proxy.base_url.removesuffix("/v1")
            out = await _fuzz(
                root,
                ["/v1/chat/completions", "/v1/completions"],
                PROXY_REQUESTS,
                seed=99,
                headers=headers,
                extra_headers=ODD_RAW_HEADERS[:3],
            )
            after = await _greedy(root, "/v1/completions", headers)
            return out, after

    before = asyncio.run(_greedy(server.base_url, "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}))
    out, after = asyncio.run(go())
    assert out["failures"] == [], "\n".join(out["failures"][:20])
    assert after == before
