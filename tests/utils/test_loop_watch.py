"""A rollout that blocks the event loop is named (file, line, whose code) and does not time out the others."""

import asyncio
import logging
import threading
import time

import pytest

from training.utils.aio.loop_watch import LoopWatchdog, wait_for


def blocking_rollout_code():
    time.sleep(2.0)  # a sync call on the loop: every other rollout stands still meanwhile


async def _run(use_watchdog: bool):
    watchdog = LoopWatchdog(threshold_s=0.5, interval_s=0.05).start() if use_watchdog else None

    async def rollout():  # 0.9 s of its own time
        for _ in range(3):
            await asyncio.sleep(0.3)
        return "done"

    async def culprit():
        await asyncio.sleep(0.1)
        blocking_rollout_code()

    try:
        results = await asyncio.gather(wait_for(rollout(), 1.5), culprit(), return_exceptions=True)
    finally:
        if watchdog is not None:
            watchdog.stop()
    return results[0], watchdog


def test_a_blocked_loop_does_not_time_out_unrelated_rollouts_and_names_the_culprit(caplog):
    caplog.set_level(logging.WARNING, logger="training.utils.aio.loop_watch")
    result, watchdog = asyncio.run(_run(use_watchdog=True))
    assert result == "done"
    assert any("blocking_rollout_code" in r.getMessage() for r in caplog.records)
    assert len(watchdog.stalls) == 1 and 1.5 < watchdog.stalls[0][1] - watchdog.stalls[0][0] < 3.0
    plain, _ = asyncio.run(_run(use_watchdog=False))  # plain wait_for counts the stall: it times out
    assert isinstance(plain, asyncio.TimeoutError)


def test_unblocked_time_still_times_out():
    async def go():
        watchdog = LoopWatchdog(threshold_s=0.5, interval_s=0.05).start()
        try:
            with pytest.raises(asyncio.TimeoutError):
                await wait_for(asyncio.sleep(5), 0.3)
        finally:
            watchdog.stop()

    t0 = time.monotonic()
    asyncio.run(go())
    assert time.monotonic() - t0 < 2


def test_a_loop_starved_while_waiting_for_io_is_not_reported_as_blocked(caplog):
    """Another thread holds the GIL in one C call: the loop sits in its selector, no rollout code is to blame."""
    caplog.set_level(logging.INFO, logger="training.utils.aio.loop_watch")

    async def go():
        watchdog = LoopWatchdog(threshold_s=0.3, interval_s=0.05).start()
        held = []

        def hog_the_gil():
            time.sleep(0.1)  # let start() return first: the loop is back in its selector when the GIL goes
            t0 = time.monotonic()
            sum(range(50_000_000))  # builtin sum never releases the GIL
            held.append(time.monotonic() - t0)

        hog = threading.Thread(target=hog_the_gil)
        try:
            await asyncio.sleep(0.2)
            hog.start()
            while hog.is_alive():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)
        finally:
            watchdog.stop()
        return watchdog, held[0]

    watchdog, held = asyncio.run(go())
    if held < 0.6:
        pytest.skip(f"the GIL was held only {held:.2f} s on this machine")
    assert watchdog.stalls, "the stall is still recorded (deadlines do not count it)"
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], "nothing blocked the loop's own code"
    assert any("stood still" in r.getMessage() and r.levelno == logging.INFO for r in caplog.records)


def test_the_culprit_is_the_first_frame_outside_the_standard_library_and_says_whose_code_it_is():
    import json
    import sys

    from training.utils.aio.loop_runner import run_loop
    from training.utils.aio.loop_watch import describe_culprit

    seen = {}

    def hook(obj):  # called by the json module: the frame above is the standard library's decoder
        seen["stdlib"] = sys._getframe(1)
        return obj

    json.loads('{"a": 1}', object_hook=hook)
    named = describe_culprit(seen["stdlib"])
    assert "in test_the_culprit_is_the_first_frame" in named and "your code" in named

    async def inside_the_library_loop():
        frame = sys._getframe()
        while frame is not None and "asyncio" not in frame.f_code.co_filename:
            frame = frame.f_back
        seen["asyncio"] = frame  # asyncio's own frames, under training's run_loop

    run_loop(inside_the_library_loop())
    named = describe_culprit(seen["asyncio"])
    assert "loop_runner.py" in named and "this library's code" in named and "your code" not in named
