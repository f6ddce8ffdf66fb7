"""Launched vLLM / SGLang servers run under ``orphan_guard``: no server outlives a SIGKILLed trainer.

The server here is Python's ``http.server`` behind a ``ServerProcess`` subclass (the same launch,
watchdog and stop path as vLLM's, without a vLLM install)."""

import os
import signal
import subprocess
import sys
import time

from tests.recipes.test_exit_cleanup import _alive, _children
from training.deployment.backends.process import ServerProcess


class StaticServer(ServerProcess):
    """``python -m http.server`` as a launched server (``/`` answers 200)."""

    engine = "http.server"
    health_path = "/"

    def _command(self) -> list[str]:
        return [sys.executable, "-m", "http.server", str(self.port), "--bind", "127.0.0.1"]


_TRAINER = """
import sys, threading, time
from tests.deployment.test_orphan_guard import StaticServer
from training.utils.config import DeployConfig
box = []
t = threading.Thread(target=lambda: box.append(StaticServer("none", DeployConfig(log_file=sys.argv[1])).start()))
t.start(); t.join()  # started from a worker thread that then exits (where PR_SET_PDEATHSIG would fire early)
time.sleep(2.0)
print(box[0].pid, flush=True)
time.sleep(600)
"""


def _wait_gone(pids: list[int], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(_alive(p) for p in pids)


def test_the_server_outlives_neither_a_sigkilled_trainer_nor_the_thread_that_started_it(tmp_path):
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True
    )
    try:
        guard = int(trainer.stdout.readline())
        servers = _children(guard)
        assert len(servers) == 1 and _alive(guard) and _alive(servers[0])  # alive after its thread ended
        trainer.kill()
        trainer.wait(timeout=30)
        assert _wait_gone([guard, servers[0]], timeout_s=20), "the server outlived its trainer"
        assert "parent" in (tmp_path / "server.log").read_text() and "is gone" in (tmp_path / "server.log").read_text()
    finally:
        trainer.kill()


def test_stop_and_the_watchdog_see_through_the_guard(tmp_path):
    from training.utils.config import DeployConfig

    dep = StaticServer("none", DeployConfig(log_file=str(tmp_path / "s.log"), max_restarts=1), watchdog_interval_s=0.2)
    dep.start()
    try:
        guard = dep.pid
        (server,) = _children(guard)
        os.kill(server, signal.SIGKILL)  # the server dies: the guard dies of the same signal, the watchdog restarts
        deadline = time.monotonic() + 30
        while not (dep.restarts and dep.restarts[0]["ok"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert dep.restarts and dep.restarts[0]["exit_code"] == -signal.SIGKILL and dep.restarts[0]["ok"]
        assert _wait_gone([guard], 5) and dep.pid != guard
        guard = dep.pid
        (server,) = _children(guard)
    finally:
        dep.stop()
    assert _wait_gone([guard, server], 5)


def test_bad_usage_is_named():
    from pathlib import Path

    guard = Path(__file__).resolve().parents[2] / "training" / "deployment" / "backends" / "orphan_guard.py"
    done = subprocess.run([sys.executable, str(guard), "x", "true"], capture_output=True, text=True, timeout=30)
    assert done.returncode != 0 and "usage" in done.stderr
