"""Event-loop watchdog: report code that blocks the loop, and keep that time off rollout deadlines.

A rollout function that calls blocking code (``time.sleep``, a sync HTTP client, a long CPU
loop) on the event loop stalls every other rollout with it. ``LoopWatchdog`` notices: a
heartbeat task stamps the time every ``interval_s``; a daemon thread that sees no stamp for
``threshold_s`` logs a warning naming the culprit, once per stall (the innermost frame of the loop's
thread outside the standard library and installed packages: ``file:line in function``, and whether it is this
library's code or the user's; the whole stack at DEBUG), and records how long the loop stood still. A loop that stood still while it was waiting for I/O (its
thread inside the selector: the process got no CPU, or another thread held the GIL) blocked nobody's
code: that stall is recorded the same way but logged at INFO, without a stack.

``wait_for(aw, timeout_s)`` is ``asyncio.wait_for`` whose deadline does not count the time the
loop was blocked (when a watchdog watches the running loop; the recipes start one): a 30 s stall caused by one rollout does not time out the others,
which could not run during it. The culprit is named by the stack in the warning, not by a
deadline.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import sysconfig
import threading
import time
import traceback
import weakref
from pathlib import Path
from typing import Any, Awaitable, Optional

log = logging.getLogger(__name__)

_watching: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopWatchdog]" = weakref.WeakKeyDictionary()


class LoopWatchdog:
    """Watches one running event loop from a daemon thread; ``blocked_s_since(t)`` is the stall time since ``t``."""

    def __init__(self, threshold_s: float = 1.0, interval_s: float = 0.1):
        if threshold_s <= interval_s:
            raise ValueError(f"threshold_s: must be > interval_s={interval_s}, got {threshold_s}")
        self.threshold_s = threshold_s
        self.interval_s = interval_s
        self.stalls: list[tuple[float, float]] = []
        """Finished stalls as (start, end) in ``time.monotonic()`` seconds (start = the last heartbeat)."""
        self._beat = time.monotonic()
        self._culprit_beats: set[float] = set()
        """Heartbeats after which the watcher saw the loop's thread in user code (not in the selector)."""
        self._loop_thread: Optional[int] = None
        self._heartbeat: Optional[asyncio.Task] = None
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "LoopWatchdog":
        """Start watching the running loop (call from inside it)."""
        loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._beat = time.monotonic()
        self._heartbeat = loop.create_task(self._tick())
        _watching[loop] = self
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            self._heartbeat = None
        for loop in [lp for lp, w in _watching.items() if w is self]:
            del _watching[loop]

    async def _tick(self) -> None:
        while True:
            now = time.monotonic()
            if now - self._beat > self.threshold_s:
                self.stalls.append((self._beat, now))
                if self._beat in self._culprit_beats:
                    log.warning("the event loop was blocked for %.1f s", now - self._beat)
                else:
                    log.info(
                        "the event loop stood still for %.1f s waiting for I/O (the process got no CPU, or another "
                        "thread held the GIL); no rollout code blocked it",
                        now - self._beat,
                    )
            self._culprit_beats.discard(self._beat)
            self._beat = now
            await asyncio.sleep(self.interval_s)

    def _watch(self) -> None:
        reported = None
        while not self._stop.wait(self.interval_s):
            beat = self._beat
            if time.monotonic() - beat > self.threshold_s and reported != beat:
                reported = beat
                frame = sys._current_frames().get(self._loop_thread)
                if frame is not None and _waiting_for_io(frame):
                    continue
                self._culprit_beats.add(beat)
                log.warning(
                    "the event loop has been blocked for %.1f s by %s; every rollout waits meanwhile",
                    time.monotonic() - beat,
                    describe_culprit(frame),
                )
                if frame is not None:
                    log.debug("the blocked loop's stack:\n%s", "".join(traceback.format_stack(frame)))

    def blocked_s_since(self, since: float) -> float:
        """Seconds after ``since`` (monotonic) during which the loop stood still, ongoing stall included."""
        total = sum(max(0.0, end - max(start, since)) for start, end in self.stalls if end > since)
        ongoing = time.monotonic() - self._beat
        if ongoing > self.threshold_s:
            total += ongoing - max(0.0, since - self._beat)
        return total


_LIBRARY = str(Path(__file__).resolve().parents[2])
"""This package's folder (``training/``): frames under it are the library's own code."""
_THIRD_PARTY = tuple(
    str(Path(p).resolve())
    for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
)
"""The standard library and installed packages: the culprit is the first frame outside them, seen from inside."""


def describe_culprit(frame) -> str:
    """Who blocked the loop, from the innermost frame of its thread: the first frame (innermost first) that is
    neither the standard library nor an installed package (a sync HTTP client's frames lead to the user's line that
    called it). ``code that does not await at rollout.py:12 in score (your code: run the blocking call with
    asyncio.to_thread)``, or ``...(this library's code: please report it)``."""
    innermost = None
    while frame is not None:
        path = str(Path(frame.f_code.co_filename).resolve())
        innermost = innermost or frame
        if not path.startswith(_THIRD_PARTY) or path.startswith(_LIBRARY):
            break
        frame = frame.f_back
    frame = frame or innermost
    if frame is None:
        return "code that does not await (no stack)"
    path = str(Path(frame.f_code.co_filename).resolve())
    where = f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}"
    if path.startswith(_LIBRARY):
        return f"code that does not await at {where} (this library's code, not yours: please report it)"
    return f"code that does not await at {where} (your code: run the blocking call with asyncio.to_thread)"


def _waiting_for_io(frame) -> bool:
    """True when the innermost frame of the loop's thread is the selector's wait (the loop is idle, not blocked)."""
    return frame.f_code.co_filename.endswith("selectors.py") and frame.f_code.co_name in ("select", "poll")


CANCEL_GRACE_S = 2.0
"""How long ``wait_for`` waits for a timed-out awaitable to finish after cancelling it; one that is still
running then (it swallowed ``CancelledError``) is abandoned, never awaited."""

abandoned: list[asyncio.Task] = []
"""Tasks that ignored their cancellation at a deadline: left to run, referenced here so they are not
collected mid-run; ``training.utils.aio.loop_runner.run_loop`` names them at exit and does not wait for them."""


async def wait_for(aw: Awaitable[Any], timeout_s: float, watchdog: Optional[LoopWatchdog] = None) -> Any:
    """``asyncio.wait_for(aw, timeout_s)``, except that time the loop was blocked does not count.

    ``watchdog`` defaults to the one watching the running loop; without one, blocked time counts.

    Raises ``asyncio.TimeoutError`` once ``timeout_s`` of unblocked time passed, after cancelling ``aw``
    and waiting at most ``CANCEL_GRACE_S`` for it: one that swallows its cancellation is abandoned
    (logged, kept in ``abandoned``), so a deadline always returns.
    """
    watchdog = watchdog or _watching.get(asyncio.get_running_loop())
    task = asyncio.ensure_future(aw)
    t0 = time.monotonic()
    try:
        while True:
            blocked = watchdog.blocked_s_since(t0) if watchdog is not None else 0.0
            remaining = timeout_s - (time.monotonic() - t0 - blocked)
            if remaining <= 0:
                task.cancel()
                await _settle_cancelled(task)
                raise asyncio.TimeoutError()
            done, _ = await asyncio.wait({task}, timeout=remaining)
            if done:
                return task.result()
    except asyncio.CancelledError:
        task.cancel()
        raise


async def _settle_cancelled(task: asyncio.Task) -> None:
    """Wait up to ``CANCEL_GRACE_S`` for a cancelled ``task``; abandon it if it is still running."""
    done, _ = await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
    if done:
        if not task.cancelled():
            task.exception()  # retrieved: a late failure of a timed-out call is not reported again
        return
    abandoned.append(task)
    log.warning(
        "%s ignored its cancellation at its deadline (it catches CancelledError and goes on; re-raise it): "
        "abandoned, still running (%d abandoned so far)",
        _describe(task),
        len(abandoned),
    )


def _describe(task: asyncio.Task) -> str:
    coro = task.get_coro()
    code = getattr(coro, "cr_code", None)
    return f"{code.co_qualname if hasattr(code, 'co_qualname') else code.co_name}()" if code else repr(coro)
