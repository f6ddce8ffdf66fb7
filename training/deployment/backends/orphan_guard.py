"""Stop a launched server when the trainer that launched it dies, even by SIGKILL.

    python training/deployment/backends/orphan_guard.py PARENT_PID -- vllm serve ...

``ServerProcess`` starts vLLM and SGLang through this guard (the embedded server watches its parent
itself). The guard is the leader of the server's process group: it runs the command as its child,
checks every ``POLL_S`` whether ``PARENT_PID`` is still its parent, and when it is not (the trainer
was killed, so the guard was re-parented), it sends SIGTERM to the whole group, then SIGKILL after
``GRACE_S``. ``PR_SET_PDEATHSIG`` cannot do this: it fires when the *thread* that forked exits, and
the trainer may start servers from a worker thread. The guard exits with the command's exit status
(a command killed by a signal makes the guard die of the same signal), so a watchdog that reads the
guard's status reads the server's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

POLL_S = 0.5
"""Seconds between checks of the parent."""
GRACE_S = 10.0
"""Seconds the group has to exit after SIGTERM before SIGKILL."""


def _stop_group(child: subprocess.Popen) -> int:
    """SIGTERM the process group, SIGKILL it after ``GRACE_S``; the child's exit status."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the guard outlives its own group signal
    os.killpg(0, signal.SIGTERM)
    try:
        return child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.killpg(0, signal.SIGKILL)
        return child.wait()


def run(parent_pid: int, cmd: list[str]) -> int:
    """Run ``cmd`` until it exits or ``parent_pid`` stops being our parent; its exit status."""
    child = subprocess.Popen(cmd)
    # A group SIGTERM/SIGINT reaches the child directly; the guard only waits for it to finish.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if os.getppid() != parent_pid:
            print(f"orphan_guard: parent {parent_pid} is gone; stopping the server", file=sys.stderr, flush=True)
            return _stop_group(child)


def main(argv: list[str]) -> None:
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        raise SystemExit("usage: python orphan_guard.py PARENT_PID -- COMMAND [ARGS...]")
    code = run(int(argv[0]), argv[2:])
    if code < 0:  # died of a signal: die of the same one
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught anyway
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])
