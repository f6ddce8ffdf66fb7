"""A test instrument: an in-process server over loopback whose real engine is held mid-generation on cue."""

from __future__ import annotations

import asyncio
import threading

from aiohttp import web

from training.deployment.engine import AsyncEngine, EngineConfig
from training.deployment.server.app import create_app


class HeldEngine:
    """Test instrument: an in-process server whose real engine is held mid-generation on cue.

    ``AsyncEngine`` behind ``create_app`` on a loopback port, served as serve.py serves it
    (handler cancellation on). The engine's step is wrapped: the step after which ``hold_after``
    new tokens exist blocks until :meth:`pause_when_held` has paused the engine, so the test
    pauses a running sequence however fast the engine decodes (no race with a client's pause).
    """

    def __init__(self, tiny_model_path: str, hold_after: int):
        self.eng = AsyncEngine(
            EngineConfig(model=tiny_model_path, max_batch_size=4, max_model_len=512, device="cpu", dtype="float32")
        )
        self.hold_after = hold_after
        self.reached, self.release = threading.Event(), threading.Event()

    async def __aenter__(self) -> "HeldEngine":
        self.runner = web.AppRunner(create_app(self.eng), handler_cancellation=True)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        host, port = self.runner.addresses[0][:2]
        self.base_url = f"http://{host}:{port}"
        inner = self.eng.engine
        step, start = inner.step, inner.counters["tokens_generated"]

        def held_step():
            out = step()
            if not self.release.is_set() and inner.counters["tokens_generated"] - start >= self.hold_after:
                self.reached.set()
                self.release.wait(30)
            return out

        inner.step = held_step
        return self

    async def pause_when_held(self) -> dict:
        """Wait for the held step, pause the engine (no step runs after the held one), return its stats."""
        assert await asyncio.to_thread(self.reached.wait, 30), "generation never reached the hold"
        pausing = asyncio.ensure_future(self.eng.pause())
        await asyncio.sleep(0)  # pause() marks the engine paused before it waits for the held step
        self.release.set()
        await pausing
        return self.eng.stats()

    async def __aexit__(self, *exc) -> None:
        self.release.set()
        await self.runner.cleanup()  # shuts the engine down
