"""The server's per-request limits, bad weight paths and group joins, the connection cap, malformed
HTTP and SIGTERM during a join: every bad request is a 4xx naming what is wrong, nothing hangs.

Real server subprocesses on the tiny model: one supervised (the ``embedded_server`` fixture) for the
400s, one started by hand (``serve.py`` with a small ``--max-connections``) for the connection tests,
and another started by hand for the SIGTERM test, which stops it.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from training.deployment.server.limits import DEFAULT_LIMITS
from training.deployment.serve import READY_PREFIX, SHUTDOWN_DEADLINE_S

KEY = "limits-key"
HANG_GUARD_S = 60.0
"""A request that has not been answered (or closed) by then counts as hung."""


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(api_key=KEY, max_model_len=128, max_batch_size=8)


def send(url: str, body, api_key=None, timeout: float = HANG_GUARD_S) -> tuple[int, str]:
    """POST ``body`` (a JSON value, or bytes sent as they are) -> (status, text)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(server, path: str, body) -> tuple[int, dict]:
    status, text = send(server.base_url + path, body, KEY)
    return status, json.loads(text)


def assert_400(out: tuple[int, dict], param: str, *words: str) -> None:
    status, body = out
    assert status == 400, out
    assert body["error"]["param"] == param, out
    for w in words:
        assert w in body["error"]["message"], out


# ---------------------------------------------------------------- weight paths


@pytest.mark.parametrize("endpoint", ["/update_weights_from_disk", "/update_weights_from_shm"])
@pytest.mark.parametrize(
    "path, words",
    [
        ("/dev/shm/a\x00b.safetensors", ("NUL",)),
        ("/tmp/" + "a/" * 3000 + "w.safetensors", ("bytes long",)),
        ("/tmp/" + "b" * 300 + ".safetensors", ("component",)),
        ("/tmp/\ud800.safetensors", ("lone surrogate",)),
        ("/etc/passwd", ("not under the server's weight folders",)),
        ("../../../../etc/shadow", ("not under the server's weight folders",)),
    ],
)
def test_invalid_weight_paths_are_400_naming_no_server_folder(server, endpoint, path, words):
    out = post(server, endpoint, json.dumps({"path": path, "weight_version": 1}).encode())
    assert_400(out, "path", *words)
    message = out[1]["error"]["message"]
    for folder in (tempfile.gettempdir(), os.getcwd(), "/dev/shm"):
        assert folder + "/" not in message.replace(path, ""), message


# ---------------------------------------------------------------- group joins


GROUP = {"master_addr": "127.0.0.1", "master_port": 29911, "rank": 1, "world_size": 2, "backend": "gloo"}


@pytest.mark.parametrize(
    "change, param",
    [
        ({"timeout_s": 1e-300}, "timeout_s"),
        ({"timeout_s": 5e-324}, "timeout_s"),
        ({"timeout_s": 0.5}, "timeout_s"),
        ({"timeout_s": 2147483648}, "timeout_s"),
        ({"timeout_s": DEFAULT_LIMITS.max_join_timeout_s + 1}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"timeout_s": "10"}, "timeout_s"),
        ({"master_port": 0}, "master_port"),
        ({"master_port": 65536}, "master_port"),
        ({"rank": 0}, "rank"),
        ({"rank": 2}, "rank"),
        ({"world_size": 1}, "world_size"),
        ({"master_addr": "127.0.0.1\x00x"}, "master_addr"),
        ({"backend": "mpi"}, "backend"),
    ],
)
def test_nonsensical_group_joins_are_400_before_any_connection(server, change, param):
    out = post(server, "/init_weight_update_group", {**GROUP, "timeout_s": 5, **change})
    assert_400(out, param)
    if param == "timeout_s":
        assert "max_join_timeout_s" in out[1]["error"]["message"]


# ---------------------------------------------------------------- generation limits


def test_chat_template_kwargs_take_only_template_variables(server):
    msgs = [{"role": "user", "content": "hi"}]
    for key, value in [
        ("return_tensors", "pt"),
        ("padding", "max_length"),
        ("max_length", 20_000_000),
        ("tokenize", False),
        ("return_dict", True),
        ("truncation", True),
        ("tokenizer_kwargs", {}),
    ]:
        out = post(
            server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {key: value}}
        )
        assert_400(out, "chat_template_kwargs", key, "only the chat template's own variables")
    out = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {"nope": 1}})
    assert_400(out, "chat_template_kwargs", "nope", "not a variable of this model's chat template")
    status, body = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "chat_template_kwargs": {}})
    assert status == 200, body


def test_the_rendered_chat_prompt_is_measured_before_it_is_tokenized(server):
    """Short messages, but tools that render to more text than the context can hold."""
    tools = [{"type": "function", "function": {"name": "f", "description": "d" * 5000, "parameters": {}}}]
    out = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": tools})
    assert_400(out, "messages", "the rendered prompt has", "limit 4096 characters")


def test_too_many_sequences_in_one_request_is_400_naming_the_limit(server):
    limit = DEFAULT_LIMITS.max_sequences_per_request
    prompts = [[1, 2, 3]] * 8
    out = post(server, "/v1/completions", {"prompt": prompts, "n": limit // 8 + 1, "max_tokens": 1})
    assert_400(out, "n", f"max_sequences_per_request={limit}")


def test_stop_strings_are_bounded_in_number_and_length(server):
    limits = DEFAULT_LIMITS
    out = post(
        server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "stop": ["x"] * (limits.max_stop_strings + 1)}
    )
    assert_400(out, "stop", f"max_stop_strings={limits.max_stop_strings}")
    out = post(
        server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "stop": ["y" * (limits.max_stop_chars + 1)]}
    )
    assert_400(out, "stop", f"max_stop_chars={limits.max_stop_chars}")
    ids = list(range(limits.max_stop_token_ids + 1))
    out = post(server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "stop_token_ids": ids})
    assert_400(out, "stop_token_ids", f"max_stop_token_ids={limits.max_stop_token_ids}")
    status, body = post(
        server, "/v1/completions", {"prompt": [1, 2], "max_tokens": 1, "stop": ["z"] * limits.max_stop_strings}
    )
    assert status == 200, body


# ---------------------------------------------------------------- a hand-started server: connections, SIGTERM

MAX_CONNECTIONS = 6


@contextlib.contextmanager
def hand_started(model_path: str, log_dir: Path):
    """``serve.py`` started by hand (no supervisor that would restart it), no API key: (process, url)."""
    log = open(log_dir / "server.log", "w+")
    cmd = [
        sys.executable,
        "-m",
        "training.deployment.serve",
        "--model",
        model_path,
        "--port",
        "0",
        "--max-model-len",
        "128",
        "--max-batch-size",
        "4",
        "--device",
        "cpu",
        "--max-connections",
        str(MAX_CONNECTIONS),
        "--idle-timeout-s",
        "3",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        url = None
        for line in proc.stdout:
            if line.startswith(READY_PREFIX):
                url = line.split()[2]
                break
        assert url, f"the server did not start: {open(log.name).read()[-3000:]}"
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep its pipe drained
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def bare(tiny_model_path, tmp_path_factory):
    with hand_started(tiny_model_path, tmp_path_factory.mktemp("bare")) as started:
        yield started


def _addr(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def _exchange(url: str, data: bytes, *, read_until_close: bool = True) -> bytes:
    """Send raw bytes; return what the server sent until it closed (or the hang guard)."""
    with socket.create_connection(_addr(url), timeout=HANG_GUARD_S) as s:
        s.sendall(data)
        out = b""
        while True:
            try:
                chunk = s.recv(65536)
            except (ConnectionResetError, BrokenPipeError):
                return out
            if not chunk:
                return out
            out += chunk
            if not read_until_close and b"\r\n\r\n" in out:
                return out


def test_over_the_connection_cap_health_answers_and_the_rest_get_503(bare):
    _, url = bare
    held = []
    try:
        for _ in range(MAX_CONNECTIONS):  # each holds its connection busy: a body that never comes
            s = socket.create_connection(_addr(url), timeout=HANG_GUARD_S)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n")
            held.append(s)
        time.sleep(0.5)  # let the server accept them (not a timing assert: the answers below do not depend on it)
        health = _exchange(url, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200") and b'"status": "ok"' in health, health
        busy = _exchange(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
        assert busy.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in busy, busy
        assert b"connection limit (6)" in busy
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + HANG_GUARD_S
    while True:  # once the held connections are gone, requests are served again
        status, text = send(url + "/v1/completions", {"prompt": [1, 2], "max_tokens": 1})
        if status == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert status == 200, text


@pytest.mark.parametrize(
    "raw",
    [
        b"GARBAGE\r\n\r\n",
        b"GET /health HTTP/9.9\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 100_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(500)) + b"\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\n",  # incomplete head: closed by the idle reaper
        b"\xff\xfe\x00\x01\r\n\r\n",
    ],
)
def test_malformed_http_is_answered_below_500_or_closed(bare, raw):
    out = _exchange(bare[1], raw)
    if out:
        status = int(out.split(b" ", 2)[1])
        if raw.count(b"\r\nX-") >= 500:  # well-formed, only many headers: aiohttp 3.9 (the floor) serves it
            assert status == 200 or 400 <= status < 500, out[:300]
        else:
            assert 400 <= status < 500, out[:300]


def test_pipelined_requests_are_all_answered(bare):
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    out = _exchange(bare[1], req * 3 + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert out.count(b"HTTP/1.1 200") == 4, out


def test_sigterm_stops_the_server_during_a_join_that_would_wait_an_hour(tiny_model_path, tmp_path):
    """On a hand-started server of its own, which it stops."""
    with hand_started(tiny_model_path, tmp_path) as (proc, url):
        port = socket.socket()
        port.bind(("127.0.0.1", 0))  # a port nothing listens on: the join retries for up to timeout_s
        body = {**GROUP, "master_port": port.getsockname()[1], "timeout_s": DEFAULT_LIMITS.max_join_timeout_s}
        port.close()
        answers: list = []

        def join() -> None:
            try:
                answers.append(send(url + "/init_weight_update_group", body, timeout=120))
            except OSError as e:  # the server went away mid-request, as it should
                answers.append(e)

        joining = threading.Thread(target=join, daemon=True)
        joining.start()
        time.sleep(1.0)  # let the join start (the outcome does not depend on it)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=SHUTDOWN_DEADLINE_S + 30)  # raises TimeoutExpired if SIGTERM is ignored
        assert proc.returncode is not None
