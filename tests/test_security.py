"""The control plane is locked by default: open binds need a key, launched servers get one."""

import pytest

from training.deployment.serve import build_parser, check_bind

pytestmark = pytest.mark.unit


def test_open_bind_without_a_key_refuses_unless_allowed(monkeypatch):
    monkeypatch.delenv("DEPLOYMENT_API_KEY", raising=False)
    parse = build_parser().parse_args
    with pytest.raises(SystemExit, match="--host 0.0.0.0: binding beyond this host without --api-key"):
        check_bind(parse(["--host", "0.0.0.0", "--model", "m"]))
    check_bind(parse(["--host", "0.0.0.0", "--model", "m", "--api-key", "k"]))
    check_bind(parse(["--host", "0.0.0.0", "--model", "m", "--allow-open-bind"]))
    check_bind(parse(["--model", "m"]))  # loopback by default
    check_bind(parse(["--host", "127.0.0.2", "--model", "m"]))


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
