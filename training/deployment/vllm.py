"""vLLM as the deployment engine: launch or attach, sample token-level, reload weights from disk.

``VLLMDeployment(model, cfg)`` has the interface of ``EmbeddedDeployment`` (context manager,
``base_url``, ``async push_weights(named_weights, weight_version, mode=..., directory=...)``).
It either launches ``python -m vllm.entrypoints.openai.api_server`` with the Python of a vLLM
venv (``cfg.engine_python``; default ``.venv-vllm/bin/python`` of this repository, made by
``scripts/setup_vllm.sh``) or, with ``cfg.base_url`` set, attaches to a running server (which
must have been started with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
training.deployment.vllm_worker.WeightReloadExtension`` for weight sync).

Sampling needs nothing special: vLLM's ``/v1/completions`` takes token-id prompts and returns
``choices[].token_ids`` (``return_token_ids``) and ``logprobs.token_logprobs``, which is what
``DeploymentSampler`` asks for. A launched server runs with ``--logprobs-mode processed_logprobs``
so the logprobs are ``log_softmax(logits / T)`` like the embedded server's (vLLM's default,
``raw_logprobs``, ignores the temperature); with ``top_p < 1`` or ``top_k`` vLLM renormalises over
the kept tokens, which the embedded server does not. Attach to a server started the same way. vLLM's OpenAI responses carry no weight version, so the sampler
labels such completions with the version it last saw confirmed *before* the request was sent
(``DeploymentSampler.note_weight_version``): never newer than the weights that produced them.

Weight sync (``push_weights``), from disk:

1. write ``<folder>/model.safetensors`` (``mode="disk"``: ``directory``; ``mode="shm"``: a
   private folder under /dev/shm, same host only);
2. ``POST /pause?mode=wait`` (default, ``wait_for_inflight=True``): in-flight requests finish on
   the old weights, new ones queue, so every completion comes from one weight version; with
   ``wait_for_inflight=False``, ``mode=keep`` freezes in-flight requests and they continue on the
   new weights after ``/resume`` (faster sync, completions may span two versions). ``abort`` is
   never used: it would cut rollouts short;
3. ``POST /collective_rpc`` ``reload_weights_and_refresh`` (the worker extension: vLLM's
   ``reload_weights`` plus the rebuild of the tied output projection, see ``vllm_worker.py``);
4. ``POST /reset_prefix_cache`` (cached KV of the old weights must not be reused);
5. ``POST /update_weight_version`` (``new_version`` as a string), then ``POST /resume``
   (always, also when a step failed, so a failed sync never leaves the server paused).

NCCL weight transfer (``/init_weight_transfer_engine``, ``/update_weights``) is GPU only and not
wired here; see training/deployment/README.md for the command to try it on a GPU.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional

from training.deployment.launcher import DeploymentStartError, free_port
from training.utils.config import DeployConfig

log = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER_EXTENSION = "training.deployment.vllm_worker.WeightReloadExtension"
RELOAD_METHOD = "reload_weights_and_refresh"


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
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base_url + path, data=data, method=method)
        req.add_header("Content-Type", "application/json")
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            return 0, str(e)

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


def default_vllm_python() -> str:
    """``.venv-vllm/bin/python`` of this repository when it exists, else the current interpreter."""
    return str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.exists() else sys.executable


class VLLMDeployment(ServerProcessDeployment):
    """vLLM's OpenAI-compatible server, launched from ``cfg.engine_python`` or attached by URL."""

    engine = "vllm"

    def __init__(self, model: str, cfg: Optional[DeployConfig] = None, *, log_file: Optional[str] = None,
                 base_url: Optional[str] = None, stop_grace_s: float = 15.0, extra_args: Iterable[str] = (),
                 refresh_tied_output: bool = True):
        super().__init__(model, cfg, log_file=log_file, base_url=base_url, stop_grace_s=stop_grace_s,
                         extra_args=extra_args)
        self.python = self.cfg.engine_python or default_vllm_python()
        self.refresh_tied_output = refresh_tied_output
        """Reload through the worker extension (True) or vLLM's bare ``reload_weights`` (False:
        only to demonstrate the tied-embedding pitfall in tests)."""
        self.last_sync: dict[str, float] = {}
        """Timings of the last ``push_weights``: write_s, pause_s, reload_s, total_s."""

    def _dtype(self) -> str:
        if self.cfg.dtype != "auto":
            return self.cfg.dtype
        import torch

        return "auto" if torch.cuda.is_available() else "float32"  # bf16 is 4-5x slower on AVX2 CPUs

    def _command(self) -> list[str]:
        return [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
                "--host", self.host, "--port", str(self.port), "--dtype", self._dtype(), "--enforce-eager",
                "--max-model-len", str(self.cfg.max_model_len), "--max-num-seqs", str(self.cfg.max_batch_size),
                "--logprobs-mode", "processed_logprobs",  # log_softmax(logits / T): the trainer's convention
                "--worker-extension-cls", WORKER_EXTENSION, *self.extra_args]

    def _env(self) -> dict[str, str]:
        env = super()._env()
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key  # via env, not argv: keeps the key out of `ps`
        env.update(self.cfg.engine_env)
        return env

    async def server_weight_version(self) -> Optional[str]:
        """The version string vLLM reports (``GET /weight_info``); None if it has none."""
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            async with s.get(self.base_url + "/weight_info", headers=headers) as resp:
                return (await resp.json()).get("weight_version") if resp.status == 200 else None

    async def push_weights(self, named_weights: Iterable[tuple[str, Any]], weight_version: int, *,
                           mode: Optional[str] = None, directory: Optional[str] = None,
                           wait_for_inflight: bool = True) -> dict:
        """Write the weights as safetensors and reload them in the running server (steps: module doc).

        Returns ``{"path", "bytes", "write_s", "pause_s", "reload_s", "total_s", "refreshed"}``.
        Raises ``WeightSyncError`` naming the failed step; the server is resumed either way.
        """
        import asyncio

        import aiohttp

        from training.deployment.weight_sync import WeightSyncError, write_safetensors

        mode = mode or ("disk" if self.cfg.weight_sync == "disk" else "shm")
        t0 = time.perf_counter()
        folder = self._weights_folder(mode, directory)
        written = await asyncio.to_thread(write_safetensors, named_weights, folder / "model.safetensors")
        t1 = time.perf_counter()
        method = RELOAD_METHOD if self.refresh_tied_output else "reload_weights"
        timeout = aiohttp.ClientTimeout(total=max(self.cfg.request_timeout_s, 600.0))
        refreshed: Any = None
        async with aiohttp.ClientSession(timeout=timeout) as s:
            await self._post(s, "/pause", params={"mode": "wait" if wait_for_inflight else "keep"})
            t2 = time.perf_counter()
            try:
                out = await self._post(s, "/collective_rpc", {"method": method,
                                                              "kwargs": {"weights_path": str(folder)}})
                refreshed = (out or {}).get("results") if isinstance(out, dict) else out
                reset = await self._post(s, "/reset_prefix_cache",
                                         params={"reset_running_requests": "false" if wait_for_inflight else "true"})
                if isinstance(reset, dict) and reset.get("success") is False:
                    log.warning("vLLM /reset_prefix_cache answered success=false after the reload")
                await self._post(s, "/update_weight_version", {"new_version": str(int(weight_version))})
            except WeightSyncError as e:
                raise WeightSyncError(f"vLLM refused weights v{weight_version} from {folder}: {e}") from e
            finally:
                t3 = time.perf_counter()
                await self._post(s, "/resume")
        self.note_weights(str(folder), weight_version, mode)
        t4 = time.perf_counter()
        self.last_sync = {"write_s": t1 - t0, "pause_s": t2 - t1, "reload_s": t3 - t2, "total_s": t4 - t0}
        return {"path": str(folder), "bytes": written, **self.last_sync, "refreshed": refreshed}
