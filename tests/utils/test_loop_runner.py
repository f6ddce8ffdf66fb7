"""Ctrl-C / SIGTERM under ``run_loop`` stop the run even where the signal lands in code that swallows errors."""

import signal
import subprocess
import sys
import textwrap
import time

import pytest

# A loop whose every callback sits in an ``except BaseException`` that swallows (as a rollout's error
# counting or a transport's ``__del__`` does): a handler that raised where the signal landed would be lost.
SWALLOWING_LOOP = textwrap.dedent(
    """
    import asyncio, sys, time
    from training.utils.aio.loop_runner import run_loop

    async def main():
        cleaned = False
        try:
            print("ready", flush=True)
            for _ in range(20000):
                try:
                    time.sleep(0.001)  # the signal lands here, inside the swallowing try
                    await asyncio.sleep(0)
                except asyncio.CancelledError:
                    raise
                except BaseException:
                    pass
            return "finished"
        finally:
            print("cleanup ran", flush=True)

    try:
        print(run_loop(main()), flush=True)
    except KeyboardInterrupt:
        print("KeyboardInterrupt", flush=True)
        sys.exit(130)
    """
)


def _start(tmp_path):
    script = tmp_path / "loop.py"
    script.write_text(SWALLOWING_LOOP)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.2)
    return proc


@pytest.mark.parametrize(
    ("signum", "code", "last"), [(signal.SIGINT, 130, "KeyboardInterrupt"), (signal.SIGTERM, 143, None)]
)
def test_the_first_signal_stops_the_loop_after_its_cleanup(tmp_path, signum, code, last):
    proc = _start(tmp_path)
    proc.send_signal(signum)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == code
    lines = out.split()
    assert "finished" not in out  # the loop did not run on to its end
    assert "cleanup" in lines  # the main coroutine's finally ran before the exit
    if last:
        assert out.strip().endswith(last)


def test_a_second_signal_exits_at_once_even_when_the_loop_is_blocked(tmp_path):
    script = tmp_path / "blocked.py"
    script.write_text(
        textwrap.dedent(
            """
            import asyncio, time
            from training.utils.aio.loop_runner import run_loop

            async def main():
                print("ready", flush=True)
                time.sleep(60)  # synchronous code holding the loop: the first signal waits for it

            run_loop(main())
            """
        )
    )
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert proc.poll() is None  # the loop is blocked: the first press can only be queued
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=10) == 130
    assert time.monotonic() - t0 < 10


def test_handlers_found_at_start_are_put_back():
    import asyncio

    from training.utils.aio.loop_runner import run_loop

    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)

    async def main():
        assert signal.getsignal(signal.SIGTERM) is not before[0]
        await asyncio.sleep(0)
        return 7

    assert run_loop(main()) == 7
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
