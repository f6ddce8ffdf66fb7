"""A server we launch as a child process (or attach to by URL): the lifecycle vLLM and SGLang share.

``ServerProcessDeployment`` starts the engine's command on a free loopback port, waits for its
health endpoint, stops it at exit, and offers small HTTP helpers to the engine adapters
(``vllm.py``, ``sglang.py``). The embedded server has its own launcher (``launcher.py``) because
it also restarts a dead child and reloads the newest weights into it.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from training.deployment.launcher import DeploymentStartError, free_port, http_request
from training.utils.config import DeployConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]


class ServerProcessDeployment:
    """An inference server we launch as a child process (or attach to by URL): shared lifecycle.

    Subclasses give ``_command()``, ``_env()`` and ``push_weights``. Launch: a free loopback port,
    output to a log file, wait for ``GET /health`` (``DeploymentStartError`` with the log's tail
    when the child exits or is not healthy within ``cfg.startup_timeout_s``), SIGTERM then SIGKILL
    on ``stop()``, on leaving the ``with`` block and at interpreter exit. Attach (``base_url``):
    health is checked at ``start()``, nothing is started or stopped. No automatic restart (the
    engines have their own supervision); ``ensure_alive()`` raises if a launched server died.
    """

    engine = "server"
    health_path = "/health"

    def __init__(self, model: str, cfg: Optional[DeployConfig] = None, *, log_file: Optional[str] = None,
                 base_url: Optional[str] = None, stop_grace_s: float = 15.0, extra_args: Iterable[str] = ()):
        self.model = str(model)
        self.cfg = cfg or DeployConfig()
        url = base_url if base_url is not None else self.cfg.base_url
        if isinstance(url, list):
            raise ValueError("base_url: one deployment object attaches to one URL; make one per replica")
        self.attached_url = url.rstrip("/") if url else None
        """The URL of a server we attach to; None when we launch one."""
        self.api_key = self.cfg.api_key
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(self.cfg.engine_args) + list(extra_args)
        self.log_path = Path(log_file or self.cfg.log_file or
                             Path(tempfile.gettempdir()) / f"{self.engine}-{os.getpid()}-{id(self):x}.log")
        self.host = self.cfg.host
        self.port = self.cfg.port
        self.restarts: list[dict[str, Any]] = []
        """Always empty: kept for interface parity with ``EmbeddedDeployment``."""
        self.latest_weights: Optional[dict[str, Any]] = None
        """The last pushed weights: ``{"path", "weight_version", "mode"}``."""
        self.startup_s: Optional[float] = None
        """Seconds from launch to a healthy /health (None when attached)."""
        self._proc: Optional[subprocess.Popen] = None
        self._log_fh = None
        self._owned_dirs: list[Path] = []

    # ------------------------------------------------------------ properties
    @property
    def base_url(self) -> str:
        if self.attached_url:
            return self.attached_url
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    @property
    def restart_count(self) -> int:
        return 0

    def is_alive(self) -> bool:
        if self.attached_url:
            return self._http("GET", self.health_path, timeout=5.0)[0] == 200
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self):
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self):
        """Launch the server and wait for health, or check an attached server's health. Idempotent."""
        if self.attached_url:
            status, text = self._http("GET", self.health_path, timeout=10.0)
            if status != 200:
                raise DeploymentStartError(f"{self.engine} server at {self.attached_url} is not healthy: "
                                           f"GET {self.health_path} -> {status or 'no answer'}: {text[:500]}")
            return self
        if self._proc is not None and self._proc.poll() is None:
            return self
        if not self.port:
            self.port = free_port("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
        atexit.register(self.stop)
        try:
            self._spawn_and_wait()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop a launched server (SIGTERM to its process group, SIGKILL after the grace period). Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=self.stop_grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
            except ProcessLookupError:
                pass
        if self._log_fh is not None:
            self._log_fh.close()
            self._log_fh = None
        for d in self._owned_dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._owned_dirs.clear()
        atexit.unregister(self.stop)

    def ensure_alive(self) -> bool:
        """False while the server runs; raises ``DeploymentStartError`` (with the log's tail) if it died."""
        if self.is_alive():
            return False
        where = self.attached_url or f"log {self.log_path}:\n{self.log_tail()}"
        raise DeploymentStartError(f"the {self.engine} server is gone (no automatic restart); {where}")

    def note_weights(self, path: str, weight_version: int, mode: str = "disk") -> None:
        """Record the latest weights pushed (kept for interface parity; used in error messages)."""
        self.latest_weights = {"path": str(path), "weight_version": int(weight_version), "mode": mode}

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------ internals
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        return dict(os.environ, PYTHONUNBUFFERED="1")

    def _weights_folder(self, mode: str, directory: Optional[str]) -> Path:
        """Where a push writes its safetensors: ``directory`` (disk) or a private /dev/shm folder (shm)."""
        from training.deployment.weight_sync import shm_dir

        if mode == "disk":
            if not directory:
                raise ValueError("directory: required with mode='disk'")
            folder = Path(directory).resolve()
        elif mode == "shm":
            if self.attached_url and self.cfg.host not in ("127.0.0.1", "localhost"):
                log.warning("mode='shm' writes to this host's /dev/shm; the server must run on the same host")
            owned = [d for d in self._owned_dirs if d.parent == shm_dir()]
            folder = owned[0] if owned else shm_dir() / f"training-{self.engine}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            if not owned:
                self._owned_dirs.append(folder)
        else:
            raise ValueError(f"mode: {mode!r} is not one of ('shm', 'disk')")
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def _spawn_and_wait(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_fh is None:
            self._log_fh = open(self.log_path, "ab", buffering=0)
        cmd = self._command()
        self._log_fh.write(f"=== {time.strftime('%H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        t0 = time.monotonic()
        self._proc = subprocess.Popen(cmd, stdout=self._log_fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                      env=self._env(), start_new_session=True, cwd=str(self.log_path.parent))
        deadline = t0 + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise DeploymentStartError(f"{self.engine} server exited with code {code} during startup; "
                                           f"log {self.log_path}:\n{self.log_tail()}")
            if self._http("GET", self.health_path, timeout=2.0)[0] == 200:
                self.startup_s = time.monotonic() - t0
                log.info("%s server ready at %s after %.1f s", self.engine, self.base_url, self.startup_s)
                return
            time.sleep(0.5)
        raise DeploymentStartError(f"{self.engine} server not healthy after {self.cfg.startup_timeout_s} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")

    def _http(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 10.0) -> tuple[int, str]:
        return http_request(method, self.base_url + path, body, api_key=self.api_key, timeout=timeout)

    async def _post(self, session: Any, path: str, body: Optional[dict] = None,
                    params: Optional[dict] = None) -> Any:
        """POST to the server; raise ``WeightSyncError`` naming the step on an error answer."""
        from training.deployment.weight_sync import WeightSyncError

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with session.post(self.base_url + path, json=body, params=params, headers=headers) as resp:
            text = await resp.text()
            if resp.status >= 400:
                raise WeightSyncError(f"{self.base_url}{path}: HTTP {resp.status}: {text[:2000]}")
            try:
                return json.loads(text) if text else None
            except ValueError:
                return text
