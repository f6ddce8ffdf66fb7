"""Seeded fuzzing of the inference server: every bad request is a 4xx (the proxy's: ``test_proxy_fuzz.py``).

Each target gets malformed JSON, wrong types, extreme numbers, huge and deeply nested bodies,
invalid UTF-8, lone surrogates, disconnects mid-body and bursts; the server also gets odd
``chat_template_kwargs``, odd paths for the weight endpoints, odd group joins (timeout, port,
rank) and requests at or past its limits (``server/limits.py``). The tests assert that no answer
is a 5xx, that no request hangs, and that a valid greedy request (the canary) returns exactly what
it returned before. The quick test (a few hundred requests, in batches with the canary between
them) runs in the suite; the long one is ``slow``. The helpers here (``_fuzz``, the body makers)
serve the proxy's fuzz too.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from typing import Optional
from urllib.parse import urlparse

import aiohttp
import pytest


API_KEY = "fuzz-key"
PROMPT = [5, 17, 42, 99, 7]
SERVER_REQUESTS = 1000
QUICK_BATCHES = 6
QUICK_BATCH_REQUESTS = 50
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


ODD_PATHS = [
    "",
    "/dev/shm/w\x00.safetensors",
    "/tmp/\x00",
    "/tmp/" + "a/" * 2100 + "w.safetensors",
    "/dev/shm/" + "n" * 256 + ".safetensors",
    "/dev/shm/../../etc/passwd",
    "../../../../../../etc/shadow",
    "/proc/self/mem",
    "/dev/shm/fuzz-missing.safetensors",
    "/dev/shm/fuzz-missing/",
    "\\\\server\\share",
    "~/.ssh/id_rsa",
    "é" * 300,
    "\ud800",
    123,
    None,
    ["/dev/shm/x"],
]
"""Weight paths that must each get a 4xx (none names an existing folder: a folder is read whole)."""

BAD_GROUP_VALUES = {
    "timeout_s": [1e-300, 5e-324, 0, -1, 0.5, 2147483648, 1e308, 3601, True, "5", None, [], {}],
    "master_port": [0, -1, 65536, 2**63, 1.5, "29500", None, True],
    "rank": [0, -1, 2, 2**31, 1.0, "1", None],
    "world_size": [0, 1, -5, 2**20, "2", None],
    "master_addr": ["", 5, None, "a" * 300, "127.0.0.1\x00", "\u2603" * 10, "10.0.0.1"],
    "backend": ["mpi", "", None, 1, "NCCL"],
}
"""For each field of an ``/init_weight_update_group`` body: values that must be refused before any join."""

ODD_TEMPLATE_KWARGS = [
    {"return_tensors": "pt"},
    {"padding": "max_length", "max_length": 20_000_000},
    {"tokenize": False},
    {"return_dict": True},
    {"truncation": True, "max_length": 1},
    {"tokenizer_kwargs": {"padding": True}},
    {"return_assistant_tokens_mask": True},
    {"continue_final_message": True},
    {"add_generation_prompt": "yes"},
    {"messages": []},
    {"tools": [{}]},
    {"chat_template": "{{ 1 }}"},
    {"bos_token": "x" * 100},
    {"enable_thinking": [1] * 1000},
    {"\x00": 1},
    "not an object",
    [1, 2],
]


def _extreme_body(rng: random.Random, chat: bool) -> dict:
    """A generation body at or beyond a limit: huge lists within the body cap, many stops, many sequences."""
    base: dict = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": list(PROMPT)}
    base.update(max_tokens=2, temperature=0.0)
    kind = rng.randrange(9)
    if kind == 0:
        base["chat_template_kwargs" if chat else "stop"] = rng.choice(
            ODD_TEMPLATE_KWARGS if chat else [["x"] * 300_000]
        )
    elif kind == 1:
        base["stop"] = ["s" * rng.choice([10, 5000, 100_000])] * rng.choice([1, 65, 1000])
    elif kind == 2:
        base["stop_token_ids"] = list(range(rng.choice([1025, 200_000])))
    elif kind == 3:
        base["n"] = rng.choice([257, 1000, 2**31])
    elif kind == 4 and not chat:
        base["prompt"] = [list(PROMPT)] * rng.choice([8, 256]) if rng.random() < 0.5 else [1] * 300_000
        base["n"] = rng.choice([129, 256])
    elif kind == 4:
        base["messages"] = [{"role": "user", "content": "m"}] * rng.choice([10_000, 100_000])
    elif kind == 5:
        base["logit_bias"] = {str(i): 1 for i in range(rng.choice([1000, 50_000]))}
    elif kind == 6:
        base["max_tokens"] = rng.choice([0, -1, 10**6, 2**64 - 1, 2**63])
    elif kind == 7:
        base["seed"] = rng.choice([2**64, -(2**63) - 1, 2**64 - 1])
        base["n"] = 2
    else:
        base["chat_template_kwargs" if chat else "prompt"] = (
            rng.choice(ODD_TEMPLATE_KWARGS) if chat else "\x00" * rng.choice([1, 10_000])
        )
    return base


def _control_body(rng: random.Random, path: str) -> dict:
    """An odd body for a weight endpoint: a bad path, or a group join with one field out of range."""
    if path == "/init_weight_update_group":
        body = {"master_addr": "127.0.0.1", "master_port": 29555, "rank": 1, "world_size": 2, "backend": "gloo"}
        body["timeout_s"] = 2
        field = rng.choice(sorted(BAD_GROUP_VALUES))
        body[field] = rng.choice(BAD_GROUP_VALUES[field])
        return body
    if path == "/update_weights_from_distributed":  # metadata only: with no group joined nothing is received
        body = {"names": ["model.embed_tokens.weight"], "dtypes": ["float32"], "shapes": [[1]], "weight_version": 1}
        body["update_id"] = "u1"
        for _ in range(rng.randrange(1, 3)):
            body[rng.choice(["names", "dtypes", "shapes", "weight_version", "update_id", "wait_for_inflight"])] = (
                rng.choice(_weird_values(rng) + [["x"] * 10_000, [[2**62] * 8], "\x00", "a" * 200])
            )
        return body
    body = {"path": rng.choice(ODD_PATHS), "weight_version": rng.choice([1, -1, 2**63, "1", None])}
    if rng.random() < 0.2:
        body["force"] = rng.choice([True, "yes", 1])
    return body


def _quick_body(rng: random.Random, path: str) -> bytes:
    """One request of the quick fuzz: the generic malformations, or an extreme / control body."""
    if path in ("/v1/completions", "/v1/chat/completions"):
        chat = "chat" in path
        body = _body(rng, chat) if rng.random() < 0.5 else json.dumps(_extreme_body(rng, chat)).encode()
    else:
        body = json.dumps(_control_body(rng, path)).encode("utf-8", "surrogatepass")
    return body


async def _raw(
    url: str, path: str, head_extra: bytes, body: bytes, close_early: bool, auth: str = f"Bearer {API_KEY}"
) -> Optional[int]:
    """Send bytes over a plain socket (disconnect mid-body when ``close_early``); the answer's status, else None."""
    u = urlparse(url)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: {auth}\r\nContent-Length: {len(body) + (100 if close_early else 0)}\r\n"
    )
    writer.write(head.encode() + head_extra + b"\r\n" + body)
    await writer.drain()
    status = None
    if not close_early:
        first = await asyncio.wait_for(reader.readline(), REQUEST_TIMEOUT_S)  # b"HTTP/1.1 400 Bad Request\r\n"
        parts = first.split()
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
    writer.close()
    return status


async def _fuzz(
    url: str,
    paths: list[str],
    n: int,
    seed: int,
    headers: dict,
    extra_headers: list[bytes],
    make_body=None,
    timeout_s: float = REQUEST_TIMEOUT_S,
    make_headers=None,
    odd_header_every: int = 50,
    odd_header_auth=None,
) -> dict:
    """Send ``n`` fuzzed requests (``make_body(rng, path)``, default ``_body``); statuses and failures
    (a 5xx, or no answer within ``timeout_s``). A path ``"GET /x"`` is fetched with GET (no body);
    ``make_headers(rng, path)``, when given, replaces ``headers`` per request. One request in
    ``odd_header_every`` goes over a raw socket with one of ``extra_headers``, authorised with
    ``odd_header_auth(path)`` when given, else with the request's own ``Authorization``."""
    rng = random.Random(seed)
    statuses: dict[int, int] = {}
    failures: list[str] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        async def one(i: int) -> None:
            path = rng.choice(paths)
            method, _, path = path.rpartition(" ")
            body = make_body(rng, path) if make_body else _body(rng, chat="chat" in path or "messages" in path)
            sent = make_headers(rng, path) if make_headers else headers
            try:
                if method == "GET":
                    async with http.get(url + path, headers=sent) as resp:
                        text = await resp.text()
                        statuses[resp.status] = statuses.get(resp.status, 0) + 1
                        if resp.status >= 500:
                            failures.append(f"GET {path} {sent} -> {resp.status} {text[:300]}")
                    return
                if i % 50 == 7:  # a client that goes away mid-body
                    await _raw(url, path, b"", body, close_early=True)
                    return
                if (
                    i % odd_header_every == 13 % odd_header_every and extra_headers
                ):  # non-ASCII session ids, huge values
                    auth = odd_header_auth(path) if odd_header_auth else sent.get("Authorization", f"Bearer {API_KEY}")
                    extra = rng.choice(extra_headers)
                    status = await _raw(url, path, extra, body, close_early=False, auth=auth)
                    if status is not None:
                        statuses[status] = statuses.get(status, 0) + 1
                    if status is not None and status >= 500:  # None: closed unanswered (header abuse may be)
                        failures.append(f"{path} header {extra[:80]!r} -> {status}")
                    return
                async with http.post(
                    url + path, data=body, headers={"Content-Type": "application/json", **sent}
                ) as resp:
                    text = await resp.text()
                    statuses[resp.status] = statuses.get(resp.status, 0) + 1
                    if resp.status >= 500:
                        failures.append(f"{path} {sent} {body[:300]!r} -> {resp.status} {text[:300]}")
            except asyncio.TimeoutError:
                failures.append(f"{path} {body[:300]!r} -> no answer within {timeout_s} s")
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
def server(embedded_server):
    # fresh: the fuzz aims at every endpoint, the weight and group ones too
    return embedded_server(fresh=True, api_key=API_KEY, max_batch_size=16, max_model_len=256)


QUICK_PATHS = [
    "/v1/completions",
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/chat/completions",
    "/update_weights_from_disk",
    "/update_weights_from_shm",
    "/init_weight_update_group",
    "/update_weights_from_distributed",
]


def test_quick_fuzz_is_all_4xx_or_2xx_and_the_canary_never_changes(server):
    """A few hundred seeded odd requests in batches; the greedy canary is answered identically
    before and after every batch, no answer is a 5xx and none takes over 30 s."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    canary = asyncio.run(_greedy(server.base_url, "/v1/completions", headers))
    statuses: dict[int, int] = {}
    for batch in range(QUICK_BATCHES):
        out = asyncio.run(
            _fuzz(
                server.base_url,
                QUICK_PATHS,
                QUICK_BATCH_REQUESTS,
                seed=4321 + batch,
                headers=headers,
                extra_headers=[],
                make_body=_quick_body,
                timeout_s=30.0,
            )
        )
        assert out["failures"] == [], f"batch {batch}:\n" + "\n".join(out["failures"][:20])
        for code, count in out["statuses"].items():
            statuses[code] = statuses.get(code, 0) + count
        assert asyncio.run(_greedy(server.base_url, "/v1/completions", headers)) == canary, f"after batch {batch}"
    assert sum(statuses.values()) >= QUICK_BATCHES * QUICK_BATCH_REQUESTS * 0.9, statuses
    assert statuses.get(400, 0) > QUICK_BATCHES * QUICK_BATCH_REQUESTS // 2, statuses  # the fuzz hits validation


@pytest.mark.slow
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
