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

import logging
import os
import sys
import time
from typing import Any, Iterable, Optional

from training.deployment.server_process import REPO_ROOT, ServerProcessDeployment
from training.utils.config import DeployConfig

log = logging.getLogger(__name__)

VLLM_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
WORKER_EXTENSION = "training.deployment.vllm_worker.WeightReloadExtension"
RELOAD_METHOD = "reload_weights_and_refresh"


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
