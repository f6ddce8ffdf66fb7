"""Seeded fuzzing of the inference server and the recording proxy: every bad request is a 4xx.

Each target gets malformed JSON, wrong types, extreme numbers, huge and deeply nested bodies,
invalid UTF-8, lone surrogates, disconnects mid-body and bursts. The test asserts that no answer
is a 5xx, that no request hangs, and that a valid greedy request afterwards returns exactly what
it returned before the fuzzing.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from urllib.parse import urlparse

import aiohttp
import pytest

from training.deployment.embedded import EmbeddedDeployment
from training.proxy import ProxyServer
from training.utils import DeployConfig, EngineConfig

pytestmark = pytest.mark.slow

API_KEY = "fuzz-key"
PROMPT = [5, 17, 42, 99, 7]
SERVER_REQUESTS = 1000
PROXY_REQUESTS = 500
REQUEST_TIMEOUT_S = 60.0

GENERATION_FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "seed",
    "stop",
    "stop_token_ids",
    "logprobs",
    "top_logprobs",
    "return_token_ids",
    "ignore_eos",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "tools",
    "tool_choice",
    "stream",
    "stream_options",
    "chat_template_kwargs",
    "user",
    "echo",
    "response_format",
]


def _weird_values(rng: random.Random) -> list:
    return [
        None,
        True,
        False,
        0,
        -1,
        1,
        2**64,
        -(2**63) - 1,
        10**400,
        1e308,
        -1e308,
        1e-320,
        0.5,
        "",
        "x",
        "\ud800",
        "\x00",
        "é" * 50,
        "9" * 5000,
        [],
        [1, 2],
        [[1]],
        ["a"],
        [None],
        {},
        {"a": 1},
        [rng.randrange(-5, 300_000) for _ in range(rng.randrange(1, 20))],
        "a" * rng.randrange(1, 20_000),
    ]


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _body(rng: random.Random, chat: bool) -> bytes:
    """One fuzzed request body (bytes: some are not even valid JSON or UTF-8)."""
    base: dict = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": list(PROMPT)}
    base.update(max_tokens=2, temperature=0.0)
    kind = rng.randrange(12)
    if kind == 0:  # malformed JSON
        text = json.dumps(base)
        return text[: rng.randrange(len(text))].encode()
    if kind == 1:  # invalid UTF-8
        return b'{"prompt": "\xff\xfe\xfa", "max_tokens": 2}'
    if kind == 2:  # deep nesting
        return ('{"prompt": ' + _nested(rng.choice([100, 1000, 5000])) + "}").encode()
    if kind == 3:  # an integer with thousands of digits
        return ('{"prompt": [1, 2], "max_tokens": ' + "9" * rng.choice([500, 4400, 10000]) + "}").encode()
    if kind == 4:  # lone surrogate escapes
        return (
            b'{"prompt": "\\ud800abc", "max_tokens": 2}'
            if not chat
            else b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'
        )
    if kind == 5:  # not an object
        return json.dumps(rng.choice([[], 1, "s", None, [base]])).encode()
    if kind == 6:  # messages / prompt of the wrong shape
        bad = rng.choice(_weird_values(rng))
        body = dict(base)
        body["messages" if chat else "prompt"] = bad
        if chat and rng.random() < 0.5:
            body["messages"] = [{"role": rng.choice(["user", "tool", "x", None, 3]), "content": bad}]
        return json.dumps(body).encode()
    if kind == 7:  # NaN / Infinity literals
        return ('{"prompt": [1, 2], "temperature": ' + rng.choice(["NaN", "Infinity", "-Infinity"]) + "}").encode()
    # kinds 8-11: one to three fields with wrong or extreme values
    body = dict(base)
    for _ in range(rng.randrange(1, 4)):
        body[rng.choice(GENERATION_FIELDS)] = rng.choice(_weird_values(rng))
    try:
        return json.dumps(body).encode("utf-8", "surrogatepass")
    except ValueError:
        return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


async def _raw(url: str, path: str, head_extra: bytes, body: bytes, close_early: bool) -> None:
    """Send bytes over a plain socket (disconnect mid-body when ``close_early``)."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body) + (100 if close_early else 0)}\r\n"
    )
    writer.write(head.encode() + head_extra + b"\r\n" + body)
    await writer.drain()
    if not close_early:
        await asyncio.wait_for(reader.read(65536), REQUEST_TIMEOUT_S)
    writer.close()


async def _fuzz(url: str, paths: list[str], n: int, seed: int, headers: dict, extra_headers: list[bytes]) -> dict:
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(i: int) -> None:
            path = rng.choice(paths)
            body = _body(rng, chat="chat" in path or "messages" in path)
            try:
                if i % 50 == 7:  # a client that goes away mid-body
                    await _raw(url, path, b"", body, close_early=True)
                    return
                if i % 50 == 13 and extra_headers:  # odd headers (non-ASCII session ids, huge values)
                    await _raw(url, path, rng.choice(extra_headers), body, close_early=False)
                    return
                async with http.post(
                    url + path, data=body, headers={**headers, "Content-Type": "application/json"}
                ) as resp:
                    text = await resp.text()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    if resp.status >= 500:
                        failures.append(f"{path} {body[:300]!r} -> {resp.status} {text[:300]}")
            except asyncio.TimeoutError:
                failures.append(f"{path} {body[:300]!r} -> no answer within {REQUEST_TIMEOUT_S} s")
            except (aiohttp.ClientError, ConnectionError, socket.error):
                pass  # our own disconnects

        i = 0
        while i < n:
            burst = rng.choice([1, 1, 1, 8, 32])  # mostly one by one, sometimes a burst
            await asyncio.gather(*(one(i + k) for k in range(min(burst, n - i))))
            i += burst
    return {"statuses": statuses, "failures": failures}


async def _greedy(url: str, path: str, headers: dict) -> list:
    async with aiohttp.ClientSession() as http:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0.0, "return_token_ids": True, "ignore_eos": True}
        async with http.post(url + path, json=body, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    cfg = DeployConfig(api_key=API_KEY, engine_config=EngineConfig(max_batch_size=16, max_model_len=256))
    with EmbeddedDeployment(tiny_model_path, cfg, log_file=str(log)) as dep:
        yield dep


def test_server_answers_every_fuzzed_request_below_500_and_still_serves(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    before = asyncio.run(_greedy(server.base_url, "/v1/completions", headers))
    paths = [
        "/v1/completions",
        "/v1/chat/completions",
        "/update_weights_from_disk",
        "/update_weights_from_shm",
        "/init_weight_update_group",
    ]
    out = asyncio.run(_fuzz(server.base_url, paths, SERVER_REQUESTS, seed=1234, headers=headers, extra_headers=[]))
    assert out["failures"] == [], "\n".join(out["failures"][:20])
    assert sum(out["statuses"].values()) >= SERVER_REQUESTS * 0.9
    assert asyncio.run(_greedy(server.base_url, "/v1/completions", headers)) == before


def test_proxy_answers_every_fuzzed_request_below_500_and_still_serves(server):
    async def go():
        async with ProxyServer([server.base_url], upstream_api_key=API_KEY) as proxy:
            headers = {"Authorization": f"Bearer {proxy.api_key}", "x-multi-turn-session-id": "fuzz"}
            odd = [
                "x-multi-turn-session-id: s\xe9ss\xeeon\r\n".encode("latin-1"),
                b"x-multi-turn-session-id: " + b"s" * 20000 + b"\r\n",
                "x-session-affinity: \u2603\r\n".encode("utf-8"),
            ]
            root = proxy.base_url.removesuffix("/v1")
            out = await _fuzz(
                root,
                ["/v1/chat/completions", "/v1/completions"],
                PROXY_REQUESTS,
                seed=99,
                headers=headers,
                extra_headers=odd,
            )
            after = await _greedy(root, "/v1/completions", headers)
            return out, after

    before = asyncio.run(_greedy(server.base_url, "/v1/completions", {"Authorization": f"Bearer {API_KEY}"}))
    out, after = asyncio.run(go())
    assert out["failures"] == [], "\n".join(out["failures"][:20])
    assert after == before
