"""``ProxyRolloutFn`` is closed explicitly: its serve task ends and its port is released.

No model is needed: the proxy starts without calling its upstream (nothing listens there).
"""

import asyncio
import gc
import logging
import socket

import pytest

from training.deployment.client import DeploymentSampler
from training.proxy import make_proxy_rollout_fn
from training.utils.rl.rollout import RolloutSetup


def port_listens(port: int) -> bool:
    """A real TCP connect to 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def agent(row, endpoint):
    return "5"


def test_several_rollout_fns_on_one_loop_close_and_free_their_ports(caplog):
    caplog.set_level(logging.ERROR, logger="asyncio")

    async def go():
        sampler = DeploymentSampler("http://127.0.0.1:9/v1")  # never called
        setup = RolloutSetup(sampler=sampler, tokenizer=None, sampling_kwargs={"temperature": 1.0})
        make = make_proxy_rollout_fn(agent, reward_fn=lambda row, answer: 0.0, template_check="off")
        try:
            fns = [make(setup) for _ in range(3)]
            ports, hosts = [], []
            for fn in fns[:2]:
                proxy = await fn.ensure_started()
                ports.append(proxy.port)
                hosts.append(fn._host)
            async with fns[2] as entered:
                assert entered is fns[2]
                ports.append(fns[2].proxy.port)
                hosts.append(fns[2]._host)
                assert all(port_listens(p) for p in ports)
            assert not port_listens(ports[2]) and hosts[2].done()  # __aexit__ closed it
            for fn in fns[:2]:
                await fn.close()
                await fn.close()  # idempotent
            assert all(h.done() for h in hosts) and setup.weight_sync_hooks == []
            assert not any(port_listens(p) for p in ports)
            with pytest.raises(RuntimeError, match="ProxyRolloutFn is closed"):
                await fns[0]({"q": "x"})
            del fns, hosts
            gc.collect()
            await asyncio.sleep(0)
        finally:
            await sampler.close()

    asyncio.run(go())
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []  # no "Task was destroyed"
