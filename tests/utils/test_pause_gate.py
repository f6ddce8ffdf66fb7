"""``PauseGate`` (``training/utils/aio/pause_gate.py``): counted pausers and the drain, alone and behind
the proxy's real ``/proxy/pause`` / ``/proxy/resume`` endpoints in front of a real server (tiny model)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.held_engine import HeldEngine
from training.proxy import ProxyServer
from training.utils.aio.pause_gate import PauseGate


async def _settle(turns: int = 20) -> None:
    """Let every ready task run (no timing: a fixed number of event-loop turns)."""
    for _ in range(turns):
        await asyncio.sleep(0)


async def _admitted(gate: PauseGate, log: list, name: str, release: asyncio.Event | None = None) -> None:
    async with gate.admitted():
        log.append(f"start {name}")
        if release is not None:
            await release.wait()
        log.append(f"end {name}")


def test_one_resume_of_two_pausers_keeps_the_gate_closed():
    async def go():
        gate, log = PauseGate(), []
        gate.pause()
        gate.pause()
        call = asyncio.create_task(_admitted(gate, log, "a"))
        await _settle()
        assert log == [] and gate.paused and gate.in_flight == 0
        gate.resume()  # the first pauser is done; the second still holds the gate
        await _settle()
        assert log == [] and gate.paused and gate.pausers == 1
        gate.resume()
        await call
        assert log == ["start a", "end a"] and not gate.paused
        with pytest.raises(RuntimeError, match="not paused"):
            gate.resume()

    asyncio.run(go())


def test_drain_waits_for_work_in_flight_before_pause_returns():
    async def go():
        gate, log, release = PauseGate(), [], asyncio.Event()
        running = asyncio.create_task(_admitted(gate, log, "a", release))
        await _settle()
        assert gate.in_flight == 1
        pausing = asyncio.create_task(gate.pause_and_drain())
        await _settle()
        assert not pausing.done() and gate.paused  # "a" still runs: a pause never cancels it
        late = asyncio.create_task(_admitted(gate, log, "b"))
        release.set()
        await pausing
        assert running.done() and gate.in_flight == 0 and log == ["start a", "end a"]
        await _settle()
        assert log == ["start a", "end a"]  # "b" waits while paused
        gate.resume()
        await late
        assert log[-2:] == ["start b", "end b"]

    asyncio.run(go())


def test_work_woken_by_a_resume_that_a_new_pause_follows_stays_out():
    """Resume then pause again before the woken waiter runs: it must not slip in after the drain."""

    async def go():
        gate, log = PauseGate(), []
        gate.pause()
        waiter = asyncio.create_task(_admitted(gate, log, "a"))
        await _settle()
        gate.resume()
        gate.pause()  # same turn: the waiter was woken but has not run yet
        await gate.drain()
        await _settle()
        assert log == [] and gate.in_flight == 0
        gate.resume()
        await waiter
        assert log == ["start a", "end a"]

    asyncio.run(go())


def test_pausing_block_resumes_however_it_ends():
    async def go():
        gate = PauseGate()
        with pytest.raises(ValueError):
            async with gate.pausing(drain=True):
                assert gate.paused
                raise ValueError("sync failed")
        assert not gate.paused and gate.pausers == 0

    asyncio.run(go())


# ---------------------------------------------------------------- through the proxy's HTTP endpoints


async def _post(s: aiohttp.ClientSession, proxy: ProxyServer, path: str, body: dict | None = None):
    async with s.post(f"http://{proxy.host}:{proxy.port}{path}", json=body or {}) as r:
        return r.status, await r.json()


async def _health(s: aiohttp.ClientSession, proxy: ProxyServer) -> dict:
    async with s.get(f"http://{proxy.host}:{proxy.port}/health") as r:
        return await r.json()


def _completion(max_tokens: int) -> dict:
    return {"model": "m", "prompt": [1, 7, 201], "max_tokens": max_tokens, "ignore_eos": True, "user": "s-1"}


def test_proxy_http_resume_reopens_only_after_every_pause(tiny_model_path):
    async def go():
        async with HeldEngine(tiny_model_path, hold_after=1) as held:
            held.release.set()  # never held: this test only counts pausers
            async with (
                ProxyServer([held.base_url]) as proxy,
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.api_key}"}) as s,
            ):
                first = await _post(s, proxy, "/proxy/pause")
                second = await _post(s, proxy, "/proxy/pause")
                call = asyncio.create_task(_post(s, proxy, "/v1/completions", _completion(2)))
                one = await _post(s, proxy, "/proxy/resume")
                await asyncio.sleep(0.2)  # room for a wrongly reopened gate to let the call through
                health = await _health(s, proxy)
                assert not call.done()  # one pauser is left: the call waits
                two = await _post(s, proxy, "/proxy/resume")
                status, reply = await call
                extra = await _post(s, proxy, "/proxy/resume")
                return first, second, one, health, two, status, reply, extra

    first, second, one, health, two, status, reply, extra = asyncio.run(go())
    assert first == (200, {"status": "paused", "pausers": 1, "in_flight": 0})
    assert second == (200, {"status": "paused", "pausers": 2, "in_flight": 0})
    assert one == (200, {"status": "paused", "pausers": 1})
    assert health["paused"] is True and health["pausers"] == 1 and health["in_flight"] == 0
    assert two == (200, {"status": "running", "pausers": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == 2
    assert extra[0] == 409 and "not paused" in extra[1]["error"]["message"]


def test_proxy_http_pause_answers_after_the_call_in_flight_finished(tiny_model_path):
    n = 40

    async def go():
        async with HeldEngine(tiny_model_path, hold_after=5) as held:
            async with (
                ProxyServer([held.base_url]) as proxy,
                aiohttp.ClientSession(headers={"Authorization": f"Bearer {proxy.api_key}"}) as s,
            ):
                call = asyncio.create_task(_post(s, proxy, "/v1/completions", _completion(n)))
                assert await asyncio.to_thread(held.reached.wait, 30), "generation never reached the hold"
                pausing = asyncio.create_task(_post(s, proxy, "/proxy/pause"))
                while not (health := await _health(s, proxy))["paused"]:  # the pause request has arrived
                    await asyncio.sleep(0.01)
                pause_answered_while_held = pausing.done()
                held.release.set()  # the engine goes on; the call finishes, then the pause answers
                paused = await pausing
                status, reply = await call
                resumed = await _post(s, proxy, "/proxy/resume")
                return health, pause_answered_while_held, paused, status, reply, resumed

    health, pause_answered_while_held, paused, status, reply, resumed = asyncio.run(go())
    assert health["in_flight"] == 1 and not pause_answered_while_held  # the call held mid-generation is drained
    assert paused == (200, {"status": "paused", "pausers": 1, "in_flight": 0})
    assert status == 200 and reply["usage"]["completion_tokens"] == n  # finished, not cut by the pause
    assert resumed == (200, {"status": "running", "pausers": 0})
