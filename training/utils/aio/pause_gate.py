"""``PauseGate``: hold new work while something (a weight sync) runs, and wait for work in flight.

    gate = PauseGate()
    async with gate.admitted():          # around each call / episode: waits while paused, counted in flight
        ...
    async with gate.pausing(drain=True): # around a weight sync: no new work starts; running work finished
        ...

Contract:

- **Counted pausers.** ``pause()`` adds a pauser, ``resume()`` removes one; the gate is open only
  when every pauser resumed, so two independent pausers (the recipe's weight sync and an operator's
  ``POST /proxy/pause``) never reopen it for each other. ``resume()`` without a pause is an error.
- **Admission.** ``admitted()`` waits while the gate is paused, then counts the work as in flight
  until its block ends (however it ends). Work woken by a ``resume`` that a new ``pause`` follows
  before it runs waits again: nothing is admitted while paused.
- **Drain.** ``drain()`` waits until nothing is in flight; pause first, or new work keeps arriving.
  A pause never cancels running work.

Used by the proxy (``training/proxy/server.py``: agent calls) and the orchestrator
(``training/agents/orchestrator.py``: episodes).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, Optional


class PauseGate:
    """Counted pausers and an in-flight count; see the module docstring for the contract."""

    def __init__(self):
        self.pausers = 0
        """``pause()`` calls not yet resumed."""
        self.in_flight = 0
        """Blocks inside ``admitted()`` now."""
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def paused(self) -> bool:
        return self.pausers > 0

    def pause(self) -> None:
        """Add a pauser: new work waits (it is not refused) until every pauser resumed."""
        self.pausers += 1
        self._open.clear()

    def resume(self) -> None:
        """Remove a pauser; the gate reopens when it was the last."""
        if self.pausers == 0:
            raise RuntimeError("PauseGate.resume(): the gate is not paused (every pause was already resumed)")
        self.pausers -= 1
        if self.pausers == 0:
            self._open.set()

    async def drain(self, timeout_s: Optional[float] = None) -> None:
        """Wait until nothing is in flight (``asyncio.TimeoutError`` after ``timeout_s``)."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def pause_and_drain(self, timeout_s: Optional[float] = None) -> None:
        """``pause()`` then ``drain()``; the pause stays when the drain times out (``resume()`` it)."""
        self.pause()
        await self.drain(timeout_s)

    @contextlib.asynccontextmanager
    async def pausing(self, drain: bool = False) -> AsyncIterator[None]:
        """Paused for the block (resumed however it ends); ``drain=True`` also waits for running work first."""
        self.pause()
        try:
            if drain:
                await self.drain()
            yield
        finally:
            self.resume()

    @contextlib.asynccontextmanager
    async def admitted(self) -> AsyncIterator[None]:
        """One piece of work: waits while paused, then counted in flight until the block ends."""
        while self.pausers:
            await self._open.wait()
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
