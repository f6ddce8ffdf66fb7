"""An inference server as a supervised child process, or attached by URL: the one lifecycle that the
embedded server (``embedded.py``) and the vLLM / SGLang adapters (``vllm.py``, ``sglang.py``) share.

Launch (``base_url`` None): ``start()`` runs the engine's command in its own process group on a
free loopback port, sends its output to a log file and waits for its health endpoint;
``DeploymentStartError`` carries the log's tail when the child exits or is not healthy within
``cfg.startup_timeout_s``. A watchdog thread (and ``ensure_alive()``) restarts a dead child on the
same port, up to ``cfg.max_restarts`` times, and loads the latest weights into it again
(``load_weights`` of the subclass), so it comes back at the same ``weight_version``; each restart
is recorded in ``restarts``. ``stop()`` (also on leaving the ``with`` block, exceptions and Ctrl-C
included, and at interpreter exit) sends SIGTERM to the process group, then SIGKILL after
``stop_grace_s``.

Readiness (``status()``, what the sampler asks before every request: ``client.ReplicaStatus``): ``ready``,
``restarting`` from the moment the child is seen dead until a restart has loaded the latest weights again, or
``failed`` once it cannot come back (with the reason). Clients wait for a restarting server up to
``restart_wait_s``: ``RESTART_WAIT_FACTOR`` × the slowest start-up measured + ``RESTART_WAIT_SLACK_S``, logged
when the server is first ready.

``TEST_SLOW_START_ENV`` is a test-only fake: set (in this process's environment or ``cfg.engine_env``) to a number
of seconds, the launched child sleeps that long before it execs the server command, so a restart is slow without
a slow model. Never set it in a real run.

Attach (``base_url`` given): health is checked at ``start()``; nothing is started, restarted or
stopped, and ``ensure_alive()`` raises when the server stopped answering.

Weights: ``load_weights(folder, weight_version)`` (blocking; the subclass's endpoint calls) loads
``<folder>/model.safetensors`` into the running server. ``DeploymentGroup`` (``group.py``) writes
one file for all replicas and calls it on each; ``push_weights`` is the one-server shorthand.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from training.deployment.client import ReplicaStatus
from training.deployment.placement import ReplicaPlacement, parse_replica_device, server_env
from training.deployment.weights.files import WeightFolder
from training.utils.config import DeployConfig
from training.utils.http import control_request, free_port

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[3]
ORPHAN_GUARD = Path(__file__).with_name("orphan_guard.py")
"""Run as a script (stdlib only: no package imports in the guard process)."""
HEALTH_POLL_S = 0.2
"""How often a starting server's health endpoint is polled."""
ENGINE_CHECK_EVERY = 5
"""The watchdog asks a running server's ``/health`` whether its engine died every this many rounds."""
RESTART_WAIT_FACTOR = 3.0
RESTART_WAIT_SLACK_S = 30.0
"""Clients wait for a restarting server ``RESTART_WAIT_FACTOR`` × its slowest measured start-up + this long: a restart
also reloads the weights and runs on a machine busy training."""
TEST_SLOW_START_ENV = "TRAINING_TEST_SLOW_START_S"
"""Test-only fake slow start: the launched child sleeps this many seconds before it execs the server (module doc)."""
SLOW_START_SHIM = "import os, sys, time; time.sleep(float(sys.argv[1])); os.execv(sys.argv[2], sys.argv[2:])"


def engine_dead_reason(status: Optional[int], health_body: str) -> Optional[str]:
    """The reason in a ``/health`` answer of a server whose engine thread died (503 ``{"status": "dead", "reason"}``),
    else None."""
    if status != 503:
        return None
    try:
        body = json.loads(health_body)
    except ValueError:
        return None
    if isinstance(body, dict) and body.get("status") == "dead":
        return str(body.get("reason") or "no reason given")
    return None


class DeploymentStartError(RuntimeError):
    """The server did not become healthy (or died for good); the message carries the tail of its log.

    ``summary``: the same in one line (what happened, the log's last error line, the log's path), what a run
    that cannot start prints instead of a traceback."""

    def __init__(self, message: str, summary: Optional[str] = None):
        super().__init__(message)
        self.summary = summary or message.splitlines()[0]


def last_error_line(log_text: str) -> Optional[str]:
    """The last line of a log that names an exception (``ValueError: ...``, ``error: ...``), or None."""
    for line in reversed(log_text.splitlines()):
        line = line.strip()
        head = line.split(":", 1)[0]
        if ":" in line and head.endswith(("Error", "Exception")) and " " not in head or ": error: " in line:
            return line
    return None


class ServerProcess:
    """A launched (supervised) or attached inference server. Subclasses give ``_command``, ``_env``
    and ``load_weights``; ``engine`` names them in messages."""

    engine = "server"
    health_path = "/health"
    guard_parent = True
    """Launch the command under ``orphan_guard`` (stopped if this process dies, even by SIGKILL).
    False for a server that watches its parent itself."""

    def __init__(
        self,
        model: str,
        cfg: Optional[DeployConfig] = None,
        *,
        log_file: Optional[str] = None,
        base_url: Optional[str] = None,
        watchdog_interval_s: float = 1.0,
        stop_grace_s: float = 15.0,
        extra_args: Iterable[str] = (),
    ):
        self.model = str(model)
        self.cfg = cfg or DeployConfig()
        url = base_url if base_url is not None else self.cfg.base_url
        if isinstance(url, list):
            raise ValueError("base_url: one deployment object attaches to one URL; make one per replica")
        self.attached_url = url.rstrip("/") if url else None
        """The URL of a server we attach to; None when we launch one."""
        self.api_key = self.cfg.api_key
        self.watchdog_interval_s = watchdog_interval_s
        self.stop_grace_s = stop_grace_s
        self.extra_args = list(extra_args)
        self.log_path = Path(
            log_file
            or self.cfg.log_file
            or Path(tempfile.gettempdir()) / f"{self.engine}-{os.getpid()}-{id(self):x}.log"
        )
        self.host = self.cfg.host
        self.port = self.cfg.port
        self.placement: Optional[ReplicaPlacement] = (
            parse_replica_device(self.cfg.replica_devices[0]) if self.cfg.replica_devices else None
        )
        """The devices of a launched server: ``cfg.replica_devices[0]`` (``DeploymentGroup`` gives each
        replica a config naming its own); None = no ``CUDA_VISIBLE_DEVICES`` set, the engine's device as configured."""
        self.restarts: list[dict[str, Any]] = []
        """One entry per restart: ``time``, ``exit_code`` of the dead child, ``ok`` and ``error``."""
        self.latest_weights: Optional[dict[str, Any]] = None
        """The last weights loaded: ``{"folder", "weight_version", "mode"}``; loaded again after a restart."""
        self.startup_s: Optional[float] = None
        """Seconds from the last launch to a healthy server (None when attached)."""
        self.slowest_startup_s: Optional[float] = None
        """The longest ``startup_s`` measured so far: what ``restart_wait_s`` is derived from."""
        self._restarting = threading.Event()
        """Set while ``_restart`` runs (spawn, health, weights reloaded)."""
        self._failed_summary: Optional[str] = None
        self._proc: Optional[subprocess.Popen] = None
        self._log_fh = None
        self._lock = threading.RLock()
        self._stopping = threading.Event()
        self._watchdog: Optional[threading.Thread] = None
        self._failed: Optional[str] = None
        self._own_weights = None  # the WeightFolder of push_weights (one-server shorthand)
        self.on_moved: Optional[Callable[[str, str], None]] = None
        """Called with (old URL, new URL) when a restart put the server at another address (a Ray replica on another
        node, ``training/launch/replicas.py``); ``DeploymentGroup`` sets it. A local child restarts on its own port."""

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
        return len(self.restarts)

    @property
    def restart_wait_s(self) -> float:
        """How long clients wait for this server to come back: ``RESTART_WAIT_FACTOR`` × the slowest measured start-up
        + ``RESTART_WAIT_SLACK_S`` (``cfg.startup_timeout_s`` + the slack before any start-up was measured)."""
        measured = self.slowest_startup_s
        if measured is None:
            return self.cfg.startup_timeout_s + RESTART_WAIT_SLACK_S
        return RESTART_WAIT_FACTOR * measured + RESTART_WAIT_SLACK_S

    def status(self) -> Optional[ReplicaStatus]:
        """Whether a launched server is ``ready``, ``restarting`` or ``failed`` (for the sampler; never blocks: no
        lock, no HTTP). None when attached: nobody here knows whether it restarts."""
        if self.attached_url:
            return None
        if self._failed:
            return ReplicaStatus("failed", reason=self._failed_summary or self._failed.splitlines()[0])
        if self._stopping.is_set():
            return ReplicaStatus("failed", reason=f"the {self.engine} server at {self.base_url} was stopped")
        proc = self._proc
        dead = proc is None or proc.poll() is not None
        if not (self._restarting.is_set() or dead):
            return ReplicaStatus("ready")
        if dead and not self._restarting.is_set() and len(self.restarts) >= self.cfg.max_restarts:
            return ReplicaStatus("failed", reason=self._spent_summary())
        return ReplicaStatus(
            "restarting",
            budget_s=self.restart_wait_s,
            reason=f"{self.engine} server, restart {len(self.restarts) + (not self._restarting.is_set())}/"
            f"{self.cfg.max_restarts}; "
            f"its log: {self.log_path}",
        )

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
        """Launch the server, wait for health and start the watchdog; or check an attached server's health.

        Idempotent."""
        if self.attached_url:
            status, text = self._http("GET", self.health_path, timeout=10.0)
            if status != 200:
                raise DeploymentStartError(
                    f"{self.engine} server at {self.attached_url} is not healthy: "
                    f"GET {self.health_path} -> {status or 'no answer'}: {text[:500]}"
                )
            return self
        with self._lock:
            if self.is_alive():
                return self
            self._stopping.clear()
            if not self.port:
                self.port = free_port("127.0.0.1" if self.host in ("0.0.0.0", "") else self.host)
            atexit.register(self.stop)
            try:
                self._spawn_and_wait()
            except BaseException:
                self.stop()
                raise
            if self._watchdog is None or not self._watchdog.is_alive():
                self._watchdog = threading.Thread(target=self._watch, name=f"{self.engine}-watchdog", daemon=True)
                self._watchdog.start()
        return self

    def stop(self) -> None:
        """Stop the watchdog and a launched server (SIGTERM to its process group, SIGKILL after the grace
        period) and remove the weights file of ``push_weights``. Idempotent."""
        self._stopping.set()
        with self._lock:
            self._terminate()
            if self._log_fh is not None:
                self._log_fh.close()
                self._log_fh = None
            if self._own_weights is not None:
                self._own_weights.remove()
                self._own_weights = None
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        atexit.unregister(self.stop)

    def ensure_alive(self) -> bool:
        """Restart a dead launched server (within ``max_restarts``); True if it had to restart.

        Raises ``DeploymentStartError`` when the restart budget is spent, a restart fails, or an
        attached server stopped answering."""
        if self.attached_url:
            if self.is_alive():
                return False
            raise DeploymentStartError(
                f"the {self.engine} server at {self.attached_url} is not answering (attached: not restarted by us)"
            )
        with self._lock:
            if self._stopping.is_set():
                raise DeploymentStartError("the deployment was stopped")
            if self.is_alive():
                return False
            self._restart()
            return True

    def recover(self, restarts_before: int, timeout_s: float = 15.0) -> bool:
        """After a request to this launched server failed: True when the server had died and is serving
        again (restarted here or by the watchdog), so the request may be retried; False when it is
        alive and answering (the failure was its answer) or nothing changed within ``timeout_s``."""
        if self.attached_url:
            return False
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.restart_count > restarts_before:
                with self._lock:  # waits for a restart in progress
                    return self.is_alive()
            proc = self._proc
            if proc is None or proc.poll() is not None:
                self.ensure_alive()
                return True
            status, text = self._http("GET", self.health_path, timeout=2.0)
            if status == 200:
                return False
            dead = engine_dead_reason(status, text)
            if dead:  # alive but its engine is gone: restart it
                log.warning("%s server at %s: %s; restarting it", self.engine, self.base_url, dead)
                self._terminate()
                self.ensure_alive()
                return True
            time.sleep(HEALTH_POLL_S)
        return False

    # ------------------------------------------------------------ weights
    def load_weights(
        self,
        folder: str,
        weight_version: int,
        *,
        mode: str = "shm",
        wait_for_inflight: bool = True,
        force: bool = False,
    ) -> dict:
        """Load ``<folder>/model.safetensors`` into the running server as ``weight_version`` (blocking).

        ``mode`` says where the folder lives (``shm``: this host's /dev/shm; ``disk``: a folder the
        server can read). ``force`` loads a version older than the served one (this package's server
        refuses that otherwise; other engines do not check). Raises ``WeightSyncError`` naming the
        step that failed; the server keeps serving (its old weights where it refused)."""
        raise NotImplementedError

    def weight_dtype(self) -> Optional[str]:
        """The dtype the server holds its weights in, as it reports it (``GET /weight_version``'s
        ``dtype``: ``float32``, ``bfloat16``...); None when it does not say (a push then sends the
        trainer's own dtype and the server casts)."""
        status, text = self._http("GET", "/weight_version", timeout=30.0)
        if status != 200:
            return None
        try:
            dtype = json.loads(text).get("dtype")
        except (ValueError, AttributeError):
            return None
        return dtype if isinstance(dtype, str) else None

    def stats(self) -> Optional[dict]:
        """``GET /stats`` of this package's server (counters, ``kv_cache``, ``pools`` with ``rss_bytes``); None when
        the server does not answer it (vLLM, SGLang) or cannot be reached."""
        status, text = self._http("GET", "/stats", timeout=10.0)
        if status != 200:
            return None
        try:
            out = json.loads(text)
        except ValueError:
            return None
        return out if isinstance(out, dict) else None

    # ------------------------------------------------------------ sleep (colocation)
    def sleep(self, level: int = 1) -> dict:
        """``POST /sleep?level=N`` (this package's server and vLLM's): free the KV cache (1) or the weights too (2)."""
        return self._control("POST", "/sleep", params={"level": str(int(level))})

    def wake_up(self) -> dict:
        """``POST /wake_up``: allocate again what ``sleep`` freed."""
        return self._control("POST", "/wake_up")

    def is_sleeping(self) -> bool:
        """``GET /is_sleeping``."""
        return bool(self._control("GET", "/is_sleeping").get("is_sleeping"))

    def _control(self, method: str, path: str, params: Optional[dict] = None) -> dict:
        status, text = self._http(method, path, params=params, timeout=max(self.cfg.request_timeout_s, 600.0))
        if status != 200:
            raise RuntimeError(f"{self.base_url}{path}: HTTP {status or 'no answer'}: {text[:2000]}")
        try:
            out = json.loads(text) if text else {}
        except ValueError:
            out = {}
        return out if isinstance(out, dict) else {}

    def weights_arrived(self, weight_version: int) -> None:
        """A distributed push loaded ``weight_version`` into this server (``DeploymentGroup.push``); a supervisor that
        holds a restarted server back until it has the latest weights releases it here. Nothing to do by default."""

    def note_weights(self, folder: str, weight_version: int, mode: str) -> None:
        """Record the weights now live, to load them again after a restart."""
        self.latest_weights = {"folder": str(folder), "weight_version": int(weight_version), "mode": mode}

    async def push_weights(
        self,
        named_weights: Iterable[tuple[str, Any]],
        weight_version: int,
        *,
        mode: Optional[str] = None,
        directory: Optional[str] = None,
        wait_for_inflight: bool = True,
    ) -> dict:
        """Write the weights and load them into this one server (``DeploymentGroup.push`` for replicas)."""
        mode = mode or ("disk" if self.cfg.weight_sync == "disk" else "shm")
        if (
            self._own_weights is None
            or self._own_weights.mode != mode
            or (directory and self._own_weights.folder != Path(directory).resolve())
        ):
            if self._own_weights is not None:
                self._own_weights.remove()
            self._own_weights = WeightFolder(mode, directory)
        write = await self._own_weights.write_async(named_weights)
        t0 = time.perf_counter()
        folder = str(self._own_weights.folder)
        out = await asyncio.to_thread(
            self.load_weights, folder, weight_version, mode=mode, wait_for_inflight=wait_for_inflight
        )
        self.note_weights(folder, weight_version, mode)
        load_s = time.perf_counter() - t0
        return {
            **out,
            "path": str(self._own_weights.file),
            "bytes": write["bytes"],
            "write_s": write["write_s"],
            "load_s": load_s,
            "total_s": write["write_s"] + load_s,
        }

    # ------------------------------------------------------------ internals
    def _command(self) -> list[str]:
        raise NotImplementedError

    def _env(self) -> dict[str, str]:
        """This process's environment without torchrun's variables, the server's own GPUs visible
        (``placement.server_env``), and ``cfg.engine_env`` on top."""
        env = server_env(dict(os.environ, PYTHONUNBUFFERED="1"), self.placement)
        env.update(self.cfg.engine_env)
        return env

    @property
    def on_gpu(self) -> bool:
        """True when the launched server runs on a GPU: its placement has GPUs, or (unplaced) CUDA is here."""
        if self.placement is not None:
            return bool(self.placement.gpus)
        import torch

        return torch.cuda.is_available()

    def _spawn_and_wait(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        if self._log_fh is None:
            self._log_fh = open(self.log_path, "ab", buffering=0)
        cmd = self._command()
        env = self._env()
        slow = env.pop(TEST_SLOW_START_ENV, None)
        if slow:  # the test-only fake slow start (module docstring)
            cmd = [sys.executable, "-c", SLOW_START_SHIM, str(float(slow)), *cmd]
        if self.guard_parent:
            cmd = [sys.executable, str(ORPHAN_GUARD), str(os.getpid()), "--", *cmd]
        self._log_fh.write(f"=== {time.strftime('%H:%M:%S')} starting: {' '.join(cmd)}\n".encode())
        t0 = time.monotonic()
        self._proc = subprocess.Popen(
            cmd,
            stdout=self._log_fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
            cwd=str(self.log_path.parent),
        )
        deadline = t0 + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            code = self._proc.poll()
            if code is not None:
                tail = self.log_tail()
                cause = last_error_line(tail)
                raise DeploymentStartError(
                    f"{self.engine} server exited with code {code} during startup; log {self.log_path}:\n{tail}",
                    summary=f"the {self.engine} server exited during startup"
                    + (f": {cause}" if cause else "")
                    + f" (its log: {self.log_path})",
                )
            status, text = self._http("GET", self.health_path, timeout=2.0)
            dead = engine_dead_reason(status, text)
            if dead:  # up, but its engine thread failed: it will not recover
                self._terminate()
                raise DeploymentStartError(
                    f"{self.engine} server's engine died during startup: {dead}; "
                    f"log {self.log_path}:\n{self.log_tail()}",
                    summary=f"the {self.engine} server's engine died: {dead} (its log: {self.log_path})",
                )
            if status == 200:
                self.startup_s = time.monotonic() - t0
                self.slowest_startup_s = max(self.startup_s, self.slowest_startup_s or 0.0)
                log.info(
                    "%s server ready at %s after %.1f s; if it dies, requests wait up to %.0f s for its restart "
                    "(%.0f x the slowest start-up, %.1f s, + %.0f s)",
                    self.engine,
                    self.base_url,
                    self.startup_s,
                    self.restart_wait_s,
                    RESTART_WAIT_FACTOR,
                    self.slowest_startup_s,
                    RESTART_WAIT_SLACK_S,
                )
                return
            if self._stopping.is_set():
                raise DeploymentStartError(f"the {self.engine} server was stopped during startup")
            time.sleep(HEALTH_POLL_S)
        self._terminate()
        raise DeploymentStartError(
            f"{self.engine} server not healthy after {self.cfg.startup_timeout_s} s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _http(
        self, method: str, path: str, body: Optional[dict] = None, timeout: float = 10.0, params: Optional[dict] = None
    ) -> tuple[int, str]:
        return control_request(method, self.base_url + path, body, api_key=self.api_key, timeout=timeout, params=params)

    def _terminate(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        except ProcessLookupError:
            pass

    def _spent_summary(self) -> str:
        """One line: the server died with its restarts spent, the last error its log or a restart names, the log."""
        last_error = next((r["error"] for r in reversed(self.restarts) if r["error"]), None)
        cause = last_error_line(self.log_tail()) or (last_error or "").split("\n")[0]
        return (
            f"the {self.engine} server at {self.base_url} died and max_restarts={self.cfg.max_restarts} is spent"
            + (f" (last error: {cause[:300]})" if cause else "")
            + f"; its log: {self.log_path}"
        )

    def _restart(self) -> None:
        if self._failed:
            raise DeploymentStartError(self._failed)
        if len(self.restarts) >= self.cfg.max_restarts:
            self._failed_summary = self._spent_summary()
            self._failed = (
                f"{self.engine} server died and max_restarts={self.cfg.max_restarts} is spent; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
            raise DeploymentStartError(self._failed, summary=self._failed_summary)
        code = self._proc.poll() if self._proc else None
        entry: dict[str, Any] = {"time": time.time(), "exit_code": code, "ok": False, "error": None}
        self._restarting.set()  # before the entry: ``status`` never reads the new count as a spent budget
        self.restarts.append(entry)
        log.warning(
            "%s server died (exit code %s); restart %d/%d (requests to %s wait up to %.0f s for it)",
            self.engine,
            code,
            len(self.restarts),
            self.cfg.max_restarts,
            self.base_url,
            self.restart_wait_s,
        )
        try:
            self._proc = None
            self._spawn_and_wait()
            w = self.latest_weights
            if w is not None:
                try:
                    self.load_weights(w["folder"], w["weight_version"], mode=w["mode"])
                except Exception as e:  # noqa: BLE001 - reported as a failed restart
                    raise DeploymentStartError(
                        f"restarted {self.engine} server refused the latest weights "
                        f"(v{w['weight_version']}, {w['folder']}): {e}"
                    ) from e
            entry["ok"] = True
        except DeploymentStartError as e:
            entry["error"] = str(e)[:2000]
            raise
        finally:
            self._restarting.clear()

    def _watch(self) -> None:
        """Restart the child when it has exited, or when its ``/health`` says its engine died (asked every
        ``ENGINE_CHECK_EVERY`` rounds, outside the lock)."""
        rounds = 0
        while not self._stopping.wait(self.watchdog_interval_s):
            rounds += 1
            dead = None
            if not self.attached_url and rounds % ENGINE_CHECK_EVERY == 0 and self.is_alive():
                status, text = self._http("GET", self.health_path, timeout=2.0)
                dead = engine_dead_reason(status, text)
            with self._lock:
                if self._stopping.is_set() or self._failed:
                    continue
                if dead:
                    log.warning(
                        "%s server at %s: its engine died (%s); restarting it", self.engine, self.base_url, dead
                    )
                    self._terminate()
                if self.is_alive():
                    continue
                try:
                    self._restart()
                except DeploymentStartError as e:
                    log.error("%s restart failed: %s", self.engine, str(e)[:500])

    def log_tail(self, n_bytes: int = 4000) -> str:
        """The last ``n_bytes`` of the server log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - n_bytes))
                return f.read().decode(errors="replace")
        except OSError:
            return "(no log)"
