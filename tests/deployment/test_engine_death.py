"""No silent engine death: when the engine thread dies, ``/health`` says so (503 with the reason), waiting requests
fail with it at once, and new ones are refused; a bare ``cuda`` device resolves to an indexed one."""

import asyncio
import time

import aiohttp
import pytest
import torch
from aiohttp import web

from training.deployment.engine import AsyncEngine, EngineConfig, EngineDeadError, SamplingParams
from training.deployment.server.app import create_app
from training.utils.device import resolve_device


def test_bare_cuda_resolves_to_the_current_indexed_device(monkeypatch):
    """(CUDA's availability is faked: this machine has none; the resolution is what is tested.)"""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_an_engine_thread_that_dies_at_start_fails_health_and_every_request_within_a_second(tiny_model_path):
    """The thread's start is made to raise (the fault a bare ``cuda`` device caused in ``torch.cuda.set_device``),
    after a request was handed in: the request fails with the reason, ``/health`` answers 503 naming it, and the
    next request gets a 503 at once instead of hanging."""

    async def main():
        engine = AsyncEngine(EngineConfig(model=tiny_model_path, device="cpu", dtype="float32", max_batch_size=4))

        def dies_at_start():  # fault injection: the thread's set-up raises
            time.sleep(0.3)  # a request is handed in first
            raise RuntimeError("Invalid device argument: did you call init?")

        engine._run_steps = dies_at_start
        runner = web.AppRunner(create_app(engine))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        base = "http://%s:%d" % runner.addresses[0][:2]
        try:
            await engine.start()
            pending = asyncio.ensure_future(engine.generate([1, 5, 7], SamplingParams(max_tokens=8)))
            start = time.monotonic()
            with pytest.raises(EngineDeadError, match="Invalid device argument"):
                await asyncio.wait_for(pending, 5)
            assert time.monotonic() - start < 1.0
            async with aiohttp.ClientSession() as s:
                async with s.get(base + "/health") as r:
                    assert r.status == 503
                    body = await r.json()
                assert body["status"] == "dead" and "Invalid device argument" in body["reason"]
                start = time.monotonic()
                payload = {"model": engine.model_name, "prompt": [1, 5, 7], "max_tokens": 4}
                async with s.post(base + "/v1/completions", json=payload) as r:
                    assert r.status == 503
                    error = (await r.json())["error"]
                assert error["type"] == "engine_dead" and "Invalid device argument" in error["message"]
                assert time.monotonic() - start < 1.0
        finally:
            await engine.shutdown()
            await runner.cleanup()

    asyncio.run(main())
