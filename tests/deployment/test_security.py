"""The control plane is locked by default: open binds need a key, launched servers get one."""

import pytest

from training.deployment.serve import build_parser, check_bind


def test_open_bind_without_a_key_refuses_unless_allowed(monkeypatch):
    monkeypatch.delenv("DEPLOYMENT_API_KEY", raising=False)
    parse = build_parser().parse_args
    with pytest.raises(SystemExit, match="--host 0.0.0.0: binding beyond this host without --api-key"):
        check_bind(parse(["--host", "0.0.0.0", "--model", "m"]))
    check_bind(parse(["--host", "0.0.0.0", "--model", "m", "--api-key", "k"]))
    check_bind(parse(["--host", "0.0.0.0", "--model", "m", "--allow-open-bind"]))
    check_bind(parse(["--model", "m"]))  # loopback by default
    check_bind(parse(["--host", "127.0.0.2", "--model", "m"]))


def test_loopback_is_judged_by_address_not_by_a_name_that_begins_with_127(monkeypatch):
    """Every address in 127.0.0.0/8 or ::1 counts as loopback, and a name only through what it resolves to:
    ``127.attacker.example`` (which resolves to nothing here, or anywhere an attacker chooses) needs a key."""
    monkeypatch.delenv("DEPLOYMENT_API_KEY", raising=False)
    parse = build_parser().parse_args
    for host in ("127.0.0.1", "127.255.0.9", "::1", "localhost"):
        check_bind(parse(["--host", host, "--model", "m"]))
    for host in ("127.attacker.example", "127.0.0.1.nip.invalid", "0.0.0.0", "10.0.0.1"):
        with pytest.raises(SystemExit, match=f"--host {host}: binding beyond this host without --api-key"):
            check_bind(parse(["--host", host, "--model", "m"]))


@pytest.mark.parametrize(
    "raw, problem",
    [
        (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "nests deeper"),
        (b'{"seed": 18446744073709551616}', "body.seed: integer out of range"),
        (b'{"n": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"prompt": "\\ud800"}', "body.prompt: contains a lone surrogate"),
        (b'{"temperature": NaN}', "body.temperature: nan is not a number"),
        (b'{"prompt": "\xff"}', "not valid UTF-8"),
    ],
)
def test_request_bodies_are_parsed_strictly(raw, problem):
    from training.utils.http import parse_json_body

    with pytest.raises(ValueError, match=problem):
        parse_json_body(raw)
    assert parse_json_body(b'{"seed": 18446744073709551615, "x": [1.5, "\\u00e9", {"y": null}]}') == {
        "seed": 2**64 - 1,
        "x": [1.5, "é", {"y": None}],
    }


def test_connections_without_a_request_in_progress_are_closed_and_busy_ones_are_not(embedded_server):
    """Half-open and slow-header connections are closed after --idle-timeout-s; a body that trickles in
    for longer than that is still read and answered."""
    import json
    import socket
    import time
    import urllib.parse

    dep = embedded_server(max_model_len=64, extra_args=["--idle-timeout-s", "1"])
    url = urllib.parse.urlparse(dep.base_url)
    addr = (url.hostname, url.port)
    silent = [socket.create_connection(addr) for _ in range(8)]
    partial = [socket.create_connection(addr) for _ in range(8)]
    for s in partial:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # headers never finished
    body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 2}).encode()
    slow = socket.create_connection(addr)
    slow.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
    )
    for i in range(0, len(body), len(body) // 5 + 1):  # ~3 s of trickling, past the 1 s idle limit
        time.sleep(0.6)
        slow.sendall(body[i : i + len(body) // 5 + 1])
    slow.settimeout(30)
    reply = slow.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    for s in silent + partial:
        s.settimeout(10)
        assert s.recv(1024) == b"", "an idle connection was kept open"
        s.close()
    slow.close()
