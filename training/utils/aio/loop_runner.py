"""Run a recipe's event loop so that rollout work abandoned at its deadline never holds the exit.

``asyncio.run`` waits, when its coroutine has returned, for every task still pending (it cancels them
and gathers them) and for every thread of the default executor (``shutdown_default_executor``;
``asyncio.to_thread`` runs there). A rollout whose thread hangs (``to_thread`` of a call that never
returns) or whose task swallows ``CancelledError`` would keep the process alive forever after the last
step, before the final export. ``run_loop`` is ``asyncio.run`` without those two waits:

- the default executor is a ``DaemonThreadExecutor``: one daemon thread per call, started at once
  (no queue behind hung calls), never joined at shutdown or at interpreter exit;
- at the end, the tasks still pending are cancelled and given ``CANCEL_GRACE_S`` to finish; the ones
  still running then, and the executor calls still running, are named in one warning and abandoned.

Ctrl-C and SIGTERM while the loop runs (in the main thread) never raise in the middle of whatever code
the signal lands in (a rollout's ``except``, a transport's ``__del__`` would swallow the exception): the
first one cancels the main coroutine from the loop, so its ``finally`` blocks run, and ``run_loop`` then
raises ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(128 + signum)`` (SIGTERM); a second one exits the
process at once with that status (the servers follow by their orphan guard).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import signal
import threading
import time
from typing import Any, Callable, Coroutine

from training.utils.aio.loop_watch import CANCEL_GRACE_S, abandoned

logger = logging.getLogger(__name__)


class DaemonThreadExecutor(concurrent.futures.ThreadPoolExecutor):
    """An executor running each call in a daemon thread of its own; ``shutdown`` never waits.

    A ``ThreadPoolExecutor`` subclass (``loop.set_default_executor`` requires one) whose pool is unused:
    its worker threads would be joined at interpreter exit, a hung one forever."""

    def __init__(self, thread_name_prefix: str = "loop-worker"):
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._prefix = thread_name_prefix
        self._lock = threading.Lock()
        self._running: dict[int, tuple[str, float]] = {}
        """Calls in progress: id -> (function name, monotonic start)."""
        self._next_id = 0

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        name = _name_of(fn, args)
        with self._lock:
            call_id, self._next_id = self._next_id, self._next_id + 1
            self._running[call_id] = (name, time.monotonic())

        def work() -> None:
            try:
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(fn(*args, **kwargs))
                    except BaseException as e:  # noqa: BLE001 - handed to whoever awaits the future
                        future.set_exception(e)
            finally:
                with self._lock:
                    self._running.pop(call_id, None)

        threading.Thread(target=work, name=f"{self._prefix}-{name}", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Nothing to join: running calls are daemon threads, left to finish or to die with the process."""
        super().shutdown(wait=False, cancel_futures=cancel_futures)

    def running(self) -> list[str]:
        """``name (N s)`` of every call still running."""
        now = time.monotonic()
        with self._lock:
            return [f"{name} ({now - t0:.0f} s)" for name, t0 in self._running.values()]


def _name_of(fn: Callable[..., Any], args: tuple) -> str:
    # asyncio.to_thread submits functools.partial(contextvars.Context.run, func, ...): name the user's func
    inner = getattr(fn, "args", None)
    if getattr(fn, "func", None) is not None and inner and callable(inner[0]):
        fn = inner[0]
    elif args and callable(args[0]) and getattr(fn, "__name__", "") == "run":
        fn = args[0]
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__


def run_loop(main: Coroutine[Any, Any, Any]) -> Any:
    """Run ``main`` on a new event loop to completion, like ``asyncio.run``, but abandon instead of
    waiting for what is left: pending tasks that ignore cancellation and executor threads still running."""
    loop = asyncio.new_event_loop()
    executor = DaemonThreadExecutor()
    loop.set_default_executor(executor)
    asyncio.set_event_loop(loop)
    task = loop.create_task(main)
    stop = StopOnSignal(loop, task)
    try:
        result = loop.run_until_complete(task)
    except asyncio.CancelledError:
        stop.raise_if_stopped()
        raise
    except BaseException:
        if not task.done():  # an exception out of a callback: let main unwind (its finally blocks) first
            task.cancel()
            loop.run_until_complete(asyncio.wait({task}))
        raise
    finally:
        try:
            _wait_leftovers(loop, asyncio.all_tasks(loop))
            loop.run_until_complete(loop.shutdown_asyncgens())
            _report_abandoned(loop, executor)
        finally:
            stop.restore()
            asyncio.set_event_loop(None)
            loop.close()
    stop.raise_if_stopped()  # main swallowed the cancellation and returned: the run still stops
    return result


class StopOnSignal:
    """SIGINT / SIGTERM handlers for the duration of one loop (main thread only; elsewhere a no-op).

    The first signal cancels ``task`` through the loop and is remembered (``signum``); a second one
    calls ``os._exit(128 + signum)``: a loop blocked by synchronous code still stops at the second press."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, loop: asyncio.AbstractEventLoop, task: asyncio.Task):
        self.signum: int | None = None
        self._loop, self._task = loop, task
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            os._exit(128 + signum)
        self.signum = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        logger.warning("%s: stopping the run (again to force the exit)", name)
        self._loop.call_soon_threadsafe(self._task.cancel)

    def restore(self) -> None:
        """Put back the handlers found at start."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def raise_if_stopped(self) -> None:
        """Raise what the signal stands for, if one came: ``KeyboardInterrupt`` or ``SystemExit(128 + signum)``."""
        if self.signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is not None:
            raise SystemExit(128 + self.signum)


def _wait_leftovers(loop: asyncio.AbstractEventLoop, tasks: set) -> None:
    """Cancel ``tasks`` and wait at most ``CANCEL_GRACE_S`` for them (never for one that swallows it)."""
    pending = {t for t in tasks if not t.done()}
    if not pending:
        return
    for t in pending:
        t.cancel()
    loop.run_until_complete(asyncio.wait(pending, timeout=CANCEL_GRACE_S))
    for t in pending:
        if t.done() and not t.cancelled() and t.exception() is not None:
            logger.debug("a task cancelled at exit raised %r", t.exception())


def _report_abandoned(loop: asyncio.AbstractEventLoop, executor: DaemonThreadExecutor) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    abandoned.extend(t for t in tasks if t not in abandoned)  # referenced: never "destroyed but pending"
    threads = executor.running()
    if tasks or threads:
        logger.warning(
            "exiting without waiting for abandoned rollout work: %d task(s) that ignored cancellation %s, "
            "%d worker thread(s) still running %s",
            len(tasks),
            sorted({t.get_coro().__qualname__ for t in tasks}),
            len(threads),
            threads,
        )
