"""vLLM as the deployment engine: launch or attach, sample token-level, reload weights from disk.

``VLLMDeployment(model, cfg)`` is a ``ServerProcess`` like ``EmbeddedDeployment`` (context manager,
``base_url``, a watchdog that restarts a dead launched server with the latest weights,
``load_weights(folder, weight_version)``).
It either launches ``python -m vllm.entrypoints.openai.api_server`` with ``cfg.engine_python``
(None: ``.venv-vllm/bin/python``, vLLM's CPU build from ``scripts/setup_vllm.sh``, for a server on
the CPU when it exists, else the current interpreter: ``default_vllm_python``) or, with
``cfg.base_url`` set, attaches to a running server (which
must have been started with ``VLLM_SERVER_DEV_MODE=1`` and ``--worker-extension-cls
training.deployment.backends.vllm_worker.WeightReloadExtension`` for weight sync).

Sampling needs nothing special: vLLM's ``/v1/completions`` takes token-id prompts and returns
``choices[].token_ids`` (``return_token_ids``) and ``logprobs.token_logprobs``, which is what
``DeploymentSampler`` asks for. A launched server runs with ``--logprobs-mode processed_logprobs``
so the logprobs are ``log_softmax(logits / T)`` like the embedded server's (vLLM's default,
``raw_logprobs``, ignores the temperature); with ``top_p < 1`` or ``top_k`` vLLM renormalises over
the kept tokens, which the embedded server does not. On the CPU it runs ``--enforce-eager``; on a GPU
with vLLM's CUDA graphs, tensor parallel over the replica's GPUs (``DeployConfig.replica_devices``).
Attach to a server started the same way. Prompt logprobs (a distillation teacher) pass through unchanged:
``DeploymentSampler.prompt_logprobs`` sends vLLM's own ``prompt_logprobs`` field with ``max_tokens=1`` (vLLM
refuses 0) and reads its ``choices[].prompt_logprobs``. vLLM's OpenAI responses carry no weight version, so the sampler
labels such completions with the version it last saw confirmed *before* the request was sent
(``DeploymentSampler.note_weight_version``): never newer than the weights that produced them.

Weight sync, from a folder (``DeploymentGroup.push`` or ``push_weights``):

1. the group writes ``<folder>/model.safetensors`` once for every replica (``mode="disk"``: a
   folder the servers can read; ``mode="shm"``: a private folder under /dev/shm, same host only);
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

Colocation (``cfg.colocate``): the server is launched with ``--enable-sleep-mode`` (and, as always,
``VLLM_SERVER_DEV_MODE=1``), and ``sleep`` / ``wake_up`` / ``is_sleeping`` drive vLLM's own
``/sleep?level=N``, ``/wake_up``, ``/is_sleeping``. Asleep, vLLM holds the weights offloaded to host memory
(level 1) or not at all (level 2), so a push to a sleeper first wakes the weights alone
(``/wake_up?tags=weights``: at level 1 a later full wake would otherwise copy the offloaded old weights back
over the push); the KV cache wakes with ``wake_up``. Not exercised by the test suite (it needs vLLM's GPU build).

Versions: ``start`` reads ``GET /version`` and refuses a vLLM outside ``KNOWN_VLLM_VERSIONS`` naming it (the
routes above change between releases); pushes are written in the dtype vLLM serves (``weight_dtype``).

Distributed push (``weight_sync="distributed"``, ``backends/vllm_weights.py``): the same steps with step 3
replaced by ``collective_rpc receive_weights``: every worker is a member of the trainer's own process group
(joined once by ``collective_rpc join_weight_group``; gloo on CPU, NCCL with the weights on GPUs), receives the
buckets and loads them in place through vLLM's ``reload_weights(weights_iterator=...)`` (``vllm_worker.py``).
Tested over gloo against the CPU build 0.32; NCCL is written, untested here. vLLM's own weight-transfer engine
(``/init_weight_transfer_engine``, ``/update_weights``) is not used.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from typing import Any, Iterable, Optional

from training.deployment.backends.process import REPO_ROOT, DeploymentStartError, ServerProcess
from training.deployment.weights.files import WeightSyncError
from training.utils.config import DeployConfig
from training.utils.engine_choice import find_vllm_python

log = logging.getLogger(__name__)

VLLM_VENV_PYTHON = REPO_ROOT / ".venv-vllm" / "bin" / "python"
KNOWN_VLLM_VERSIONS = ((0, 32), (0, 33))
"""The vLLM minor releases whose routes this adapter was written against (``/pause?mode=``, ``/resume``,
``/collective_rpc``, ``/reset_prefix_cache?reset_running_requests=``, ``/update_weight_version``, ``/weight_info``,
``--logprobs-mode``): 0.32 is the CPU build the suite tests (``pytest -m vllm``); 0.33 is the CUDA release of the
same API. Another version is refused at start, naming it; ``TRAINING_VLLM_ANY_VERSION=1`` lets it run anyway."""
ANY_VERSION_ENV = "TRAINING_VLLM_ANY_VERSION"
WORKER_EXTENSION = "training.deployment.backends.vllm_worker.WeightReloadExtension"
RELOAD_METHOD = "reload_weights_and_refresh"


def check_vllm_version(version: Optional[str]) -> None:
    """Refuse, naming it, a vLLM version outside ``KNOWN_VLLM_VERSIONS`` (``DeploymentStartError``), unless
    ``TRAINING_VLLM_ANY_VERSION=1``; a server that does not say its version is refused the same way."""
    if os.environ.get(ANY_VERSION_ENV) == "1":
        return
    parts = (version or "").split(".")
    try:
        minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        minor = None
    if minor not in KNOWN_VLLM_VERSIONS:
        known = ", ".join(f"{a}.{b}" for a, b in KNOWN_VLLM_VERSIONS)
        raise DeploymentStartError(
            f"vLLM {version or '(version unknown: GET /version did not answer)'} is not a version this adapter knows "
            f"(its weight-sync routes were written for vLLM {known}); install one of those, or set "
            f"{ANY_VERSION_ENV}=1 to try it anyway"
        )


def default_vllm_python(on_gpu: bool) -> str:
    """The interpreter that launches vLLM when ``cfg.engine_python`` is None: for a server on the CPU
    ``.venv-vllm/bin/python`` of this repository when that venv exists (``scripts/setup_vllm.sh`` installs
    vLLM's CPU build there); on GPUs ``.venv-vllm-gpu`` when it has vLLM (the README's GPU quickstart), else the
    current interpreter (a CUDA vLLM installed beside this package); training/utils/engine_choice.py."""
    if on_gpu:
        return find_vllm_python() or sys.executable
    return str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.exists() else sys.executable


class VLLMDeployment(ServerProcess):
    """vLLM's OpenAI-compatible server, launched from ``cfg.engine_python`` or attached by URL."""

    engine = "vllm"

    def __init__(
        self,
        model: str,
        cfg: Optional[DeployConfig] = None,
        *,
        log_file: Optional[str] = None,
        base_url: Optional[str] = None,
        stop_grace_s: float = 15.0,
        extra_args: Iterable[str] = (),
        refresh_tied_output: bool = True,
    ):
        super().__init__(
            model,
            cfg,
            log_file=log_file,
            base_url=base_url,
            stop_grace_s=stop_grace_s,
            extra_args=[*(cfg or DeployConfig()).engine_args, *extra_args],
        )
        self.python = self.cfg.engine_python or default_vllm_python(self.on_gpu)
        self.refresh_tied_output = refresh_tied_output
        """Reload through the worker extension (True) or vLLM's bare ``reload_weights`` (False:
        only to demonstrate the tied-embedding pitfall in tests)."""
        self.sleep_level = 0
        """The level of the last ``sleep`` this process sent (0 awake); vLLM's /is_sleeping has no level."""
        self.weights_awake = True
        """False from a ``sleep`` until a push wakes the weights alone (``/wake_up?tags=weights``) or ``wake_up``."""
        self.last_sync: dict[str, float] = {}
        """Timings of the last ``load_weights``: pause_s, reload_s."""

    def start(self):
        """``ServerProcess.start``, then the server's vLLM version checked against ``KNOWN_VLLM_VERSIONS``."""
        super().start()
        status, text = self._http("GET", "/version", timeout=30.0)
        try:
            version = json.loads(text).get("version") if status == 200 else None
        except (ValueError, AttributeError):
            version = None
        try:
            check_vllm_version(version)
        except DeploymentStartError:
            if not self.attached_url:
                self.stop()
            raise
        return self

    def _dtype(self) -> str:
        if self.cfg.engine_config.dtype != "auto":
            return self.cfg.engine_config.dtype
        return "auto" if self.on_gpu else "float32"  # bf16 is 4-5x slower on AVX2 CPUs

    def weight_dtype(self) -> Optional[str]:
        """The dtype vLLM holds the weights in, so pushes are written in it (vLLM reports none): the launch's
        ``--dtype``, or for ``auto`` the model's own (``config.json``'s ``dtype`` / ``torch_dtype``; float16 and
        float32 models are served in them, any other as vLLM does: bfloat16). None when the model's config cannot be
        read (the trainer's dtype is sent; vLLM casts)."""
        dtype = self._dtype()
        if dtype != "auto":
            return dtype
        try:
            from transformers import AutoConfig

            config = AutoConfig.from_pretrained(self.model)
        except Exception:
            return None
        name = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "").removeprefix("torch.")
        return name if name in ("float16", "bfloat16", "float32") else "bfloat16"

    def _device_args(self) -> list[str]:
        """CPU: ``--enforce-eager`` (no CUDA graphs there). GPU: CUDA graphs (vLLM's default), tensor
        parallel over a replica's GPUs, and ``cfg.gpu_memory_fraction`` as ``--gpu-memory-utilization``."""
        if not self.on_gpu:
            return ["--enforce-eager"]
        args = []
        if self.placement is not None and len(self.placement.gpus) > 1:
            args += ["--tensor-parallel-size", str(len(self.placement.gpus))]
        if self.cfg.gpu_memory_fraction is not None:
            args += ["--gpu-memory-utilization", str(self.cfg.gpu_memory_fraction)]
        return args

    def _command(self) -> list[str]:
        return [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--dtype",
            self._dtype(),
            *self._device_args(),
            "--max-model-len",
            str(self.cfg.engine_config.max_model_len),
            "--max-num-seqs",
            str(self.cfg.engine_config.max_batch_size),
            "--logprobs-mode",
            "processed_logprobs",  # log_softmax(logits / T): the trainer's convention
            "--worker-extension-cls",
            WORKER_EXTENSION,
            *(["--served-model-name", self.cfg.deployment_id] if self.cfg.deployment_id else []),
            *(["--seed", str(self.cfg.engine_config.seed)] if self.cfg.engine_config.seed is not None else []),
            *(["--enable-sleep-mode"] if self.cfg.colocate else []),  # /sleep, /wake_up (dev mode: _env)
            *self.extra_args,
        ]

    def _env(self) -> dict[str, str]:
        env = super()._env()
        env["VLLM_SERVER_DEV_MODE"] = "1"  # /collective_rpc, /reset_prefix_cache, /sleep, /wake_up, /is_sleeping
        if not self.on_gpu:
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB of KV cache on CPU
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, (os.cpu_count() or 1) - 1)}")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        env.pop("VLLM_API_KEY", None)
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key  # via env, not argv: keeps the key out of `ps`
        env.update(self.cfg.engine_env)
        return env

    def sleep(self, level: int = 1) -> dict:
        """vLLM's ``POST /sleep?level=N`` (needs ``--enable-sleep-mode``: launched with it when ``cfg.colocate``).
        A weight push while asleep at level 2 first wakes the weights alone (``/wake_up?tags=weights``)."""
        out = super().sleep(level)
        self.sleep_level = max(self.sleep_level, int(level))
        self.weights_awake = False
        return out

    def wake_up(self) -> dict:
        out = super().wake_up()
        self.sleep_level, self.weights_awake = 0, True
        return out

    async def server_weight_version(self) -> Optional[str]:
        """The version string vLLM reports (``GET /weight_info``); None if it has none."""
        status, text = await asyncio.to_thread(self._http, "GET", "/weight_info", timeout=30.0)
        return json.loads(text).get("weight_version") if status == 200 else None

    def _post(self, path: str, body: Optional[dict] = None, params: Optional[dict] = None) -> Any:
        status, text = self._http("POST", path, body, params=params, timeout=max(self.cfg.request_timeout_s, 600.0))
        if status != 200:
            raise WeightSyncError(f"{self.base_url}{path}: HTTP {status or 'no answer'}: {text[:2000]}")
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text

    def load_weights(
        self,
        folder: str,
        weight_version: int,
        *,
        mode: str = "shm",
        wait_for_inflight: bool = True,
        force: bool = False,
    ) -> dict:
        """Reload ``<folder>/model.safetensors`` in the running server (steps 2-5 of the module doc).

        Returns ``{"pause_s", "reload_s", "refreshed"}``; raises ``WeightSyncError`` naming the failed
        step. The server is resumed either way."""
        method = RELOAD_METHOD if self.refresh_tied_output else "reload_weights"

        def reload() -> Any:
            out = self._post("/collective_rpc", {"method": method, "kwargs": {"weights_path": str(folder)}})
            return out.get("results") if isinstance(out, dict) else out

        try:
            refreshed = self._synced(reload, weight_version, wait_for_inflight)
        except WeightSyncError as e:
            raise WeightSyncError(f"vLLM refused weights v{weight_version} from {folder}: {e}") from e
        return {**self.last_sync, "refreshed": refreshed}

    def _synced(self, step: Any, weight_version: Any, wait_for_inflight: bool) -> Any:
        """Wake the weights of a sleeper, pause, ``step()`` (the weights change), reset the prefix cache, set the
        version (``weight_version``, or what it returns when callable, read after ``step``), resume (always): the
        steps every push into vLLM shares. Returns what ``step`` returned and fills ``last_sync``."""
        t0 = time.perf_counter()
        if self.sleep_level and not self.weights_awake:
            # asleep, the weights are offloaded to host memory (level 1) or discarded (level 2): wake them alone
            # (the KV cache stays asleep), so the reload writes the weights that serve; a wake at level 1 would
            # otherwise copy the offloaded old ones back over the push
            self._post("/wake_up", params={"tags": "weights"})
            self.weights_awake = True
        self._post("/pause", params={"mode": "wait" if wait_for_inflight else "keep"})
        t1 = time.perf_counter()
        try:
            out = step()
            reset = self._post(
                "/reset_prefix_cache", params={"reset_running_requests": "false" if wait_for_inflight else "true"}
            )
            if isinstance(reset, dict) and reset.get("success") is False:
                log.warning("vLLM /reset_prefix_cache answered success=false after the reload")
            version = weight_version() if callable(weight_version) else weight_version
            self._post("/update_weight_version", {"new_version": str(int(version))})
        finally:
            t2 = time.perf_counter()
            self._post("/resume")
        self.last_sync = {"pause_s": t1 - t0, "reload_s": t2 - t1}
        return out

    # ------------------------------------------------------------------ the distributed push (backends/vllm_weights.py)
    def _rpc(self, method: str, rpc_timeout_s: Optional[float] = None, **kwargs: Any) -> list:
        """``POST /collective_rpc`` of the worker extension's ``method``: one result per worker."""
        body: dict[str, Any] = {"method": method, "kwargs": kwargs}
        if rpc_timeout_s is not None:
            body["timeout"] = rpc_timeout_s
        out = self._post("/collective_rpc", body)
        results = out.get("results") if isinstance(out, dict) else None
        if not isinstance(results, list) or not results:
            raise WeightSyncError(f"{self.base_url}/collective_rpc {method}: no results in {str(out)[:500]}")
        return results

    def weight_group_members(self) -> int:
        """How many members of a weight-update group this server holds: one per vLLM worker."""
        try:
            return len(self._rpc("weight_worker_rank"))
        except WeightSyncError as e:
            raise WeightSyncError(
                f"{e} (a distributed push needs the server started with VLLM_SERVER_DEV_MODE=1 and "
                f"--worker-extension-cls {WORKER_EXTENSION})"
            ) from e

    def join_weight_group(
        self, master_addr: str, master_port: int, rank: int, world_size: int, backend: str, timeout_s: float
    ) -> dict:
        """Every worker joins the trainer's group, as members ``rank``, ``rank + 1``, ...; returns once joined."""
        results = self._rpc(
            "join_weight_group",
            rpc_timeout_s=timeout_s,
            master_addr=master_addr,
            master_port=master_port,
            rank=rank,
            world_size=world_size,
            backend=backend,
            timeout_s=timeout_s,
        )
        return {"ranks": [r.get("rank") if isinstance(r, dict) else r for r in results]}

    def receive_weights(self, body: dict) -> dict:
        """One distributed update (``DistributedWeightSender``'s metadata ``body``) inside the shared steps
        (``_synced``: pause, receive and load in place, reset the prefix cache, version, resume). Returns
        ``{"weight_version", "pause_s", "reload_s", "received_bytes", "refreshed"}``; raises ``WeightSyncError``
        naming what vLLM refused (nothing moved) or what failed after the go (the version is then -1: the
        weights may be a mix, as the embedded server reports)."""
        version = int(body["weight_version"])
        status, text = self._http("GET", "/weight_info", timeout=30.0)
        served = json.loads(text).get("weight_version") if status == 200 else None
        failed: list[str] = []
        aborted: list[bool] = []

        def receive() -> list:
            results = self._rpc(
                "receive_weights",
                rpc_timeout_s=self.cfg.request_timeout_s,
                **{k: body[k] for k in ("names", "dtypes", "shapes", "bucket_bytes", "update_id")},
            )
            failed.extend(str(r["error"]) for r in results if isinstance(r, dict) and r.get("error"))
            aborted.extend(bool(r.get("aborted")) for r in results if isinstance(r, dict))
            return results

        def new_version() -> int:
            if failed:
                return -1
            return int(served) if any(aborted) and str(served).lstrip("-").isdigit() else version

        try:
            results = self._synced(receive, new_version, body.get("wait_for_inflight", True))
        except WeightSyncError as e:
            raise WeightSyncError(f"vLLM refused weights v{version}: {e}") from e
        if failed:
            raise WeightSyncError(f"{self.base_url}: loading weights v{version} failed: {'; '.join(failed)}")
        if any(aborted):
            return {"weight_version": served, "aborted": True}
        return {
            "weight_version": version,
            **self.last_sync,
            "received_bytes": sum(r.get("received_bytes", 0) for r in results if isinstance(r, dict)),
            "refreshed": [r.get("refreshed") for r in results if isinstance(r, dict)],
        }
