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
