"""``TrainerRank``: the Ray actor of one trainer process (a plain class; ``ray.py`` wraps it with ``ray.remote``).

``run`` starts ``python SCRIPT ARGS`` with torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``...: ``ray.trainer_envs``), so the recipe's torchrun path (``training/utils/dist.py``) forms the group
unchanged, under ``orphan_guard`` (the process ends with its actor) and returns its exit code. Imports no torch: a
fresh Ray worker starts it in a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Optional, Sequence

from training.deployment import backends
from training.deployment.placement import server_env
from training.launch.node import check_writable, free_port, node_label

ORPHAN_GUARD = Path(backends.__file__).with_name("orphan_guard.py")


class TrainerRank:
    """One trainer process on this actor's node."""

    def __init__(self):
        self._proc: Optional[subprocess.Popen] = None

    def where(self) -> dict:
        """This rank's node (``node``: address, ``label``: address and node id), a free port there (rank 0's
        rendezvous), the GPUs Ray gave it and the actor's pid."""
        from training.launch.node import node_address
        from training.launch.ray_import import import_ray

        gpus = [str(g) for g in import_ray().get_gpu_ids()]
        return {"node": node_address(), "label": node_label(), "port": free_port(), "gpus": gpus, "pid": os.getpid()}

    def check_writable(self, path: str) -> str:
        return check_writable(path)

    def run(self, argv: Sequence[str], env: dict, cwd: str) -> int:
        """Run ``python *argv`` with this process's environment (torchrun's variables of another run removed), then
        ``env`` on top; its output goes to this actor's (Ray forwards it to the launcher's console). Returns the exit
        code."""
        full = server_env(os.environ, None)
        full.update(env)
        full["PYTHONUNBUFFERED"] = "1"
        cmd = [sys.executable, str(ORPHAN_GUARD), str(os.getpid()), "--", sys.executable, *argv]
        self._proc = subprocess.Popen(cmd, env=full, cwd=cwd, start_new_session=True)
        return self._proc.wait()

    def terminate(self) -> None:
        """SIGTERM the trainer process (its recipe unwinds as on Ctrl-C)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
