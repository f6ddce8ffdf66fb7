"""The proxy's deadlines as recipe settings: ``Config.proxy`` (``ProxyConfig``) is checked, reaches the proxy a
proxy rollout function starts, and is recorded only when set (a run recorded before it still resumes)."""

import asyncio

import pytest

from training.proxy import make_proxy_rollout_fn
from training.proxy.server import DEFAULT_DRAIN_TIMEOUT_S, DEFAULT_STREAM_WRITE_TIMEOUT_S
from training.recipes.config import Config
from training.utils.cli import apply_overrides
from training.utils.config import ConfigError, ProxyConfig
from training.utils.rl.rollout import RolloutSetup


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "30"])
def test_a_deadline_that_is_not_a_positive_number_of_seconds_is_refused_naming_it(bad):
    with pytest.raises(ConfigError, match="drain_timeout_s: must be a number of seconds > 0"):
        ProxyConfig(drain_timeout_s=bad)
    if isinstance(bad, (int, float)) and not isinstance(bad, bool):  # on the command line, the nested name
        with pytest.raises(SystemExit, match="proxy.stream_write_timeout_s"):
            apply_overrides(Config(base_model="m"), [f"proxy.stream_write_timeout_s={bad}"])


def test_the_recipe_deadlines_reach_the_proxy_and_are_recorded_only_when_set():
    assert (
        (DEFAULT_STREAM_WRITE_TIMEOUT_S, DEFAULT_DRAIN_TIMEOUT_S) == (30.0, 60.0) == tuple(vars(ProxyConfig()).values())
    )
    cfg = apply_overrides(Config(base_model="m"), ["proxy.drain_timeout_s=5", "proxy.stream_write_timeout_s=2.5"])
    assert cfg.to_dict()["proxy"] == {"stream_write_timeout_s": 2.5, "drain_timeout_s": 5.0}
    assert "proxy" not in Config(base_model="m").to_dict()  # at its defaults: a run recorded before it resumes

    class Sampler:
        base_url, api_key = "http://127.0.0.1:9", None

    async def go(proxy_kwargs):
        setup = RolloutSetup(sampler=Sampler(), tokenizer=None, proxy_config=cfg.proxy)
        fn = make_proxy_rollout_fn(lambda row, ep: None, reward_fn=lambda r, a: 0.0, proxy_kwargs=proxy_kwargs)(setup)
        async with fn:
            return fn.proxy.stream_write_timeout_s, fn.proxy.drain_timeout_s, fn.drain_cancelled_calls

    assert asyncio.run(go({})) == (2.5, 5.0, 0)
    assert asyncio.run(go({"drain_timeout_s": 9.0})) == (2.5, 9.0, 0)  # proxy_kwargs win
