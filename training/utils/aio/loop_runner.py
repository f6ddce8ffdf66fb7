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
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
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
    try:
        return loop.run_until_complete(task)
    except BaseException:
        if not task.done():  # Ctrl-C while the loop ran: let main unwind (its finally blocks) first
            task.cancel()
            loop.run_until_complete(asyncio.wait({task}))
        raise
    finally:
        try:
            _wait_leftovers(loop, asyncio.all_tasks(loop))
            loop.run_until_complete(loop.shutdown_asyncgens())
            _report_abandoned(loop, executor)
        finally:
            asyncio.set_event_loop(None)
            loop.close()


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
