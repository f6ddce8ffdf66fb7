"""Run the deployment server as a supervised child process of the trainer.

``EmbeddedDeployment(model, cfg)`` starts ``python -m training.deployment.serve`` on a free
loopback port, sends its output to a log file, waits for ``/health`` and exposes ``base_url``.

Lifecycle guarantees:

- ``start()`` raises ``DeploymentStartError`` with the log's tail when the child dies or is not
  healthy within ``cfg.startup_timeout_s``.
- A watchdog thread (and ``ensure_alive()``) restarts a dead child on the same port, up to
  ``cfg.max_restarts`` times; each restart is recorded in ``restarts``. After a restart the
  latest pushed weights (``push_weights`` / ``note_weights``) are loaded again, so the server
  comes back at the same ``weight_version``.
- The child is stopped (SIGTERM, then SIGKILL after ``stop_grace_s``) by ``stop()``, on leaving
  the ``with`` block (exceptions and Ctrl-C included) and at interpreter exit; it also exits by
  itself when the trainer process disappears (``--exit-with-parent``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterable, Optional

from training.utils.config import DeployConfig

log = logging.getLogger(__name__)


class DeploymentStartError(RuntimeError):
    """The server did not become healthy; the message carries the tail of its log."""


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def http_request(method: str, url: str, body: Optional[dict] = None, *, api_key: Optional[str] = None,
                 timeout: float = 10.0) -> tuple[int, str]:
    """A blocking JSON request for control calls: (status, text); status 0 when the server is unreachable."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return 0, str(e)


class EmbeddedDeployment:
    """A supervised ``training.deployment.serve`` child process (context manager)."""

    def __init__(self, model: str, cfg: Optional[DeployConfig] = None, *, log_file: Optional[str] = None,
                 served_model_name: Optional[str] = None, watchdog_interval_s: float = 1.0,
                 stop_grace_s: float = 10.0, extra_args: Iterable[str] = ()):
        self.model = model
        self.cfg = cfg or DeployConfig()
        if self.cfg.base_url is not None:
            raise ValueError("cfg.base_url: an embedded deployment starts its own server; base_url must be None")
        self.api_key = self.cfg.api_key
        self.served_model_name = served_model_name
        self.watchdog_interval_s = watchdog_interval_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(extra_args)
        self.log_path = Path(log_file or self.cfg.log_file or
                             Path(tempfile.gettempdir()) / f"deployment-{os.getpid()}-{id(self):x}.log")
        self.host = self.cfg.host
        self.port = self.cfg.port
        self.restarts: list[dict[str, Any]] = []
        """One entry per restart: ``time``, ``exit_code`` of the dead child, ``ok`` and ``error``."""
        self.latest_weights: Optional[dict[str, Any]] = None
        """The last pushed weights: ``{"path", "weight_version", "mode"}``; reloaded after a restart."""
        self._proc: Optional[subprocess.Popen] = None
        self._log_fh = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None
        self._failed: Optional[str] = None
        self._owned_weight_file: Optional[Path] = None

    # ------------------------------------------------------------ properties
    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None

    @property
    def restart_count(self) -> int:
        return len(self.restarts)

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ------------------------------------------------------------ lifecycle
    def __enter__(self) -> "EmbeddedDeployment":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> "EmbeddedDeployment":
        """Spawn the server, wait for /health, start the watchdog. Idempotent."""
        with self._lock:
            if self.is_alive():
                return self
            self._stopping.clear()
            if not self.port:
                self.port = free_port(self.host if self.host not in ("0.0.0.0", "") else "127.0.0.1")
            atexit.register(self.stop)
            try:
                self._spawn_and_wait()
            except BaseException:
                self.stop()
                raise
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch, name="deployment-watchdog", daemon=True)
                self._watchdog.start()
        return self

    def stop(self) -> None:
        """Stop the watchdog and the child (SIGTERM, SIGKILL after the grace period). Idempotent."""
        self._stopping.set()
        with self._lock:
            self._terminate()
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = None
            if self._owned_weight_file is not None:
                self._owned_weight_file.unlink(missing_ok=True)
                self._owned_weight_file = None
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        atexit.unregister(self.stop)

    def ensure_alive(self) -> bool:
        """Restart the child if it died (within ``max_restarts``). True if it had to restart.

        Raises ``DeploymentStartError`` when the restart budget is spent or a restart fails.
        """
        with self._lock:
            if self._stopping.is_set():
                raise DeploymentStartError("the deployment was stopped")
            if self.is_alive():
                return False
            self._restart()
            return True

    # ------------------------------------------------------------ weights
    def note_weights(self, path: str, weight_version: int, mode: str = "shm") -> None:
        """Record the latest weights pushed by someone else, to reload them after a restart."""
        self.latest_weights = {"path": str(path), "weight_version": int(weight_version), "mode": mode}

    async def push_weights(self, named_weights: Iterable[tuple[str, Any]], weight_version: int, *,
                           mode: Optional[str] = None, directory: Optional[str] = None,
                           wait_for_inflight: bool = True) -> dict:
        """Push weights to this server (weight_sync) and keep the file for restarts."""
        from training.deployment.weight_sync import push_weights

        mode = mode or ("disk" if self.cfg.weight_sync == "disk" else "shm")
        out = await push_weights(self.base_url, named_weights, weight_version, mode=mode, directory=directory,
                                 api_key=self.api_key, wait_for_inflight=wait_for_inflight, keep_file=True)
        with self._lock:
            if mode == "shm":
                if self._owned_weight_file is not None and str(self._owned_weight_file) != out["path"]:
                    self._owned_weight_file.unlink(missing_ok=True)
                self._owned_weight_file = Path(out["path"])
            path = out["path"] if mode == "shm" else str(Path(out["path"]).parent)
            self.note_weights(path, weight_version, mode)
        return out

    def _reload_latest_weights(self) -> None:
        w = self.latest_weights
        if w is None:
            return
        endpoint = "/update_weights_from_shm" if w["mode"] == "shm" else "/update_weights_from_disk"
        body = {"path": w["path"], "weight_version": w["weight_version"], "wait_for_inflight": True}
        status, text = self._http("POST", endpoint, body, timeout=self.cfg.startup_timeout_s)
        if status != 200:
            raise DeploymentStartError(f"restarted server refused the latest weights "
                                       f"(v{w['weight_version']}, {w['path']}): HTTP {status}: {text[:1000]}")

    # ------------------------------------------------------------ internals
    def _command(self) -> list[str]:
        cmd = [sys.executable, "-m", "training.deployment.serve", "--model", self.model, "--host", self.host,
               "--port", str(self.port), "--max-batch-size", str(self.cfg.max_batch_size),
               "--max-model-len", str(self.cfg.max_model_len), "--device", self.cfg.device,
               "--dtype", self.cfg.dtype, "--exit-with-parent", str(os.getpid())]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd + self.extra_args

    def _spawn_and_wait(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_fh is None:
            self._log_fh = open(self.log_path, "ab", buffering=0)
        self._log_fh.write(f"=== {time.strftime('%H:%M:%S')} starting: {' '.join(self._command())}\n".encode())
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("DEPLOYMENT_API_KEY", None)
        if self.api_key:
            env["DEPLOYMENT_API_KEY"] = self.api_key  # via env, not argv: keeps the key out of `ps`
        self._proc = subprocess.Popen(self._command(), stdout=self._log_fh, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                raise DeploymentStartError(f"deployment server exited with code {code} during startup; "
                                           f"log {self.log_path}:\n{self.log_tail()}")
            status, _ = self._http("GET", "/health", timeout=2.0)
            if status == 200:
                return
            if self._stopping.is_set():
                raise DeploymentStartError("the deployment was stopped during startup")
            time.sleep(0.2)
        self._terminate()
        raise DeploymentStartError(f"deployment server not healthy after {self.cfg.startup_timeout_s} s; "
                                   f"log {self.log_path}:\n{self.log_tail()}")

    def _http(self, method: str, path: str, body: Optional[dict] = None, timeout: float = 10.0) -> tuple[int, str]:
        return http_request(method, self.base_url + path, body, api_key=self.api_key, timeout=timeout)

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def _restart(self) -> None:
        if self._failed:
            raise DeploymentStartError(self._failed)
        if len(self.restarts) >= self.cfg.max_restarts:
            self._failed = (f"deployment server died and max_restarts={self.cfg.max_restarts} is spent; "
                            f"log {self.log_path}:\n{self.log_tail()}")
            raise DeploymentStartError(self._failed)
        code = self._proc.poll() if self._proc else None
        entry: dict[str, Any] = {"time": time.time(), "exit_code": code, "ok": False, "error": None}
        self.restarts.append(entry)
        log.warning("deployment server died (exit code %s); restart %d/%d", code, len(self.restarts),
                    self.cfg.max_restarts)
        try:
            self._proc = None
            self._spawn_and_wait()
            self._reload_latest_weights()
            entry["ok"] = True
        except DeploymentStartError as e:
            entry["error"] = str(e)[:2000]
            raise

    def _watch(self) -> None:
        while not self._stopping.wait(self.watchdog_interval_s):
            with self._lock:
                if self._stopping.is_set() or self._failed or self.is_alive():
                    continue
                try:
                    self._restart()
                except DeploymentStartError as e:
                    log.error("deployment restart failed: %s", str(e)[:500])

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"


def make_deployment(model: str, cfg: DeployConfig, *, log_file: Optional[str] = None,
                    base_url: Optional[str] = None) -> Any:
    """The deployment object for ``cfg.engine``, not started yet (use it as a context manager).

    ``embedded``: ``EmbeddedDeployment`` (launch only); ``vllm``: ``VLLMDeployment``; ``sglang``:
    ``SGLangDeployment``. The last two launch a server, or attach to ``base_url`` (one URL).
    All have ``base_url`` and ``async push_weights(named_weights, weight_version, mode=, directory=)``.
    """
    if cfg.engine == "embedded":
        if base_url is not None:
            raise ValueError("base_url: the embedded engine launches its own server; attach with a "
                             "DeploymentSampler and weight_sync.push_weights_to_all instead")
        return EmbeddedDeployment(model, cfg, log_file=log_file)
    if cfg.engine == "vllm":
        from training.deployment.vllm import VLLMDeployment

        return VLLMDeployment(model, cfg, log_file=log_file, base_url=base_url)
    if cfg.engine == "sglang":
        from training.deployment.sglang import SGLangDeployment

        return SGLangDeployment(model, cfg, log_file=log_file, base_url=base_url)
    raise ValueError(f"engine: {cfg.engine!r} is not one of ('embedded', 'vllm', 'sglang')")


def make_sampler(base_urls: list[str], cfg: DeployConfig, tokenizer: Any = None) -> Any:
    """The ``DeploymentSampler`` for ``cfg.engine`` (SGLang's samples through its native /generate)."""
    from training.deployment.sampler import DeploymentSampler

    if cfg.engine == "sglang":
        from training.deployment.sglang import SGLangSampler

        return SGLangSampler(base_urls, api_key=cfg.api_key, timeout_s=cfg.request_timeout_s, tokenizer=tokenizer)
    return DeploymentSampler(base_urls, api_key=cfg.api_key, timeout_s=cfg.request_timeout_s)
