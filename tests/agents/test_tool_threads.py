"""Sync tools run in their own daemon threads: no queue wait against the deadline, no blocked pool or exit."""

import asyncio
import subprocess
import sys
import time

from training.agents.tools import FunctionTool, ToolManager
from training.openai_api.tool_parsers import ToolCall


def slow_lookup(key: str) -> str:
    """A healthy but slow sync tool."""
    time.sleep(0.5)
    return key.upper()


def hung_lookup(key: str) -> str:
    """A sync tool that never returns."""
    time.sleep(3600)
    return key


def test_thirty_concurrent_half_second_calls_all_meet_a_two_second_deadline():
    manager = ToolManager([FunctionTool(slow_lookup)], timeout_s=2.0)
    calls = [ToolCall(id=str(i), name="slow_lookup", arguments={"key": f"k{i}"}) for i in range(30)]
    results = asyncio.run(manager.execute_all(calls))
    assert [r.status for r in results] == ["ok"] * 30  # asyncio's 6-worker default pool timed out 12 of 30
    assert [r.output for r in results] == [f"K{i}" for i in range(30)]


def test_hung_tools_time_out_and_leave_the_default_pool_free():
    manager = ToolManager([FunctionTool(hung_lookup)], timeout_s=0.3)

    async def go():
        hung = [ToolCall(id=str(i), name="hung_lookup", arguments={"key": "x"}) for i in range(8)]
        results = await manager.execute_all(hung)
        t0 = time.perf_counter()
        assert await asyncio.to_thread(lambda: 7) == 7  # what the trainer's step and weight writes used to share
        return results, time.perf_counter() - t0

    results, waited = asyncio.run(go())
    assert [r.status for r in results] == ["timeout"] * 8 and waited < 1.0


def test_a_hung_tool_does_not_keep_the_process_from_exiting():
    script = (
        "import asyncio\n"
        "from tests.agents.test_tool_threads import hung_lookup\n"
        "from training.agents.tools import FunctionTool, ToolManager\n"
        "from training.openai_api.tool_parsers import ToolCall\n"
        "m = ToolManager([FunctionTool(hung_lookup)], timeout_s=0.2)\n"
        "print(asyncio.run(m.execute(ToolCall(id='1', name='hung_lookup', arguments={'key': 'x'}))).status)\n"
    )
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "timeout" and time.perf_counter() - t0 < 30


def test_one_tool_with_every_thread_hung_never_refuses_another_tool():
    """Issue #29: 64 hung calls of one sync tool used to fill a process-wide bound and refuse every sync
    tool. The bound is per tool: the hung tool's 65th call is refused naming it, a healthy tool still runs."""
    from training.agents.tools import MAX_TOOL_THREADS
    import threading

    release = threading.Event()

    def stuck_fetch(key: str) -> str:
        """Blocks until the test ends."""
        release.wait()
        return key

    def quick_lookup(key: str) -> str:
        """Returns at once."""
        return key.upper()

    manager = ToolManager([FunctionTool(stuck_fetch), FunctionTool(quick_lookup)], timeout_s=0.3)

    async def go():
        stuck = [ToolCall(id=str(i), name="stuck_fetch", arguments={"key": "x"}) for i in range(MAX_TOOL_THREADS)]
        hung = await manager.execute_all(stuck)
        one_more = await manager.execute(ToolCall(id="m", name="stuck_fetch", arguments={"key": "x"}))
        healthy = await manager.execute_all(
            [ToolCall(id=f"q{i}", name="quick_lookup", arguments={"key": f"k{i}"}) for i in range(8)]
        )
        return hung, one_more, healthy

    try:
        hung, one_more, healthy = asyncio.run(go())
    finally:
        release.set()
    assert [r.status for r in hung] == ["timeout"] * MAX_TOOL_THREADS
    assert one_more.status == "error" and "stuck_fetch" in one_more.output and "still running" in one_more.output
    assert [(r.status, r.output) for r in healthy] == [("ok", f"K{i}") for i in range(8)]
