"""The embedded deployment: this package's own server (``python -m training.deployment.serve``) as a
supervised child process of the trainer, or attached by URL.

``EmbeddedDeployment(model, cfg)`` launches the server on a free loopback port with
``cfg.engine_config`` passed whole (``--engine-config JSON``), waits for ``/health`` and exposes
``base_url``. The lifecycle (watchdog restart with the latest weights, SIGTERM then SIGKILL on stop,
stop at interpreter exit) is ``ServerProcess``'s (``backends/process.py``). The child also exits by
itself when the trainer process disappears (``--exit-with-parent``).

Weights load through the server's own endpoints: ``/update_weights_from_shm`` (a safetensors file
under /dev/shm, same host) or ``/update_weights_from_disk`` (a folder the server can read).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any, Iterable, Optional

from training.deployment.backends.process import DeploymentStartError, ServerProcess
from training.deployment.weights.files import WeightSyncError
from training.utils.config import DeployConfig

__all__ = ["DeploymentStartError", "EmbeddedDeployment"]


class EmbeddedDeployment(ServerProcess):
    """A supervised ``training.deployment.serve`` child process (context manager), or one attached by URL."""

    engine = "embedded"

    def __init__(
        self,
        model: str,
        cfg: Optional[DeployConfig] = None,
        *,
        log_file: Optional[str] = None,
        base_url: Optional[str] = None,
        served_model_name: Optional[str] = None,
        watchdog_interval_s: float = 1.0,
        stop_grace_s: float = 10.0,
        extra_args: Iterable[str] = (),
    ):
        super().__init__(
            model,
            cfg,
            log_file=log_file,
            base_url=base_url,
            watchdog_interval_s=watchdog_interval_s,
            stop_grace_s=stop_grace_s,
            extra_args=extra_args,
        )
        self.served_model_name = served_model_name or self.cfg.deployment_id

    guard_parent = False  # serve.py --exit-with-parent watches the trainer itself

    def _command(self) -> list[str]:
        engine_config = dataclasses.replace(self.cfg.engine_config, model=self.model)
        if self.placement is not None:  # the child sees only its own GPUs: the first is cuda:0
            engine_config = dataclasses.replace(engine_config, device=self.placement.engine_device)
        cmd = [
            sys.executable,
            "-m",
            "training.deployment.serve",
            "--host",
            self.host,
            "--port",
            str(self.port),
            "--engine-config",
            json.dumps(dataclasses.asdict(engine_config)),
            "--exit-with-parent",
            str(os.getpid()),
        ]
        if self.served_model_name:
            cmd += ["--served-model-name", self.served_model_name]
        return cmd + self.extra_args

    def _env(self) -> dict[str, str]:
        env = super()._env()  # torchrun's variables removed, its own GPUs visible, engine_env applied
        env.pop("DEPLOYMENT_API_KEY", None)
        if self.api_key:
            env["DEPLOYMENT_API_KEY"] = self.api_key  # via env, not argv: keeps the key out of `ps`
        return env

    def load_weights(
        self,
        folder: str,
        weight_version: int,
        *,
        mode: str = "shm",
        wait_for_inflight: bool = True,
        force: bool = False,
    ) -> dict:
        """POST the file (shm) or the folder (disk) to the server; it answers once it serves the new version."""
        if mode == "shm":
            endpoint, path = "/update_weights_from_shm", os.path.join(folder, "model.safetensors")
        elif mode == "disk":
            endpoint, path = "/update_weights_from_disk", folder
        else:
            raise ValueError(f"mode: {mode!r} is not one of ('shm', 'disk')")
        body = {
            "path": path,
            "weight_version": int(weight_version),
            "wait_for_inflight": wait_for_inflight,
            "force": force,
        }
        status, text = self._http("POST", endpoint, body, timeout=max(self.cfg.request_timeout_s, 600.0))
        if status != 200:
            raise WeightSyncError(f"{self.base_url}{endpoint}: HTTP {status or 'no answer'}: {text[:2000]}")
        answer: dict[str, Any] = json.loads(text)
        if answer.get("weight_version") != weight_version:
            raise WeightSyncError(
                f"{self.base_url}: reports weight_version {answer.get('weight_version')} after loading {weight_version}"
            )
        return answer
