"""``DeployConfig.engine="auto"`` (the default): which inference engine a run launches, decided once at its start.

    choice = choose_engine(cfg.deployment, num_gpus=8)
    choice.name    # "vllm" when the replicas run on GPUs, vLLM is installed and it takes the config; else "embedded"
    choice.line    # the one start-up line that says what was picked and why (None on a CPU-only run)

The rule, in order (the first that applies decides):

| case | engine | why |
| --- | --- | --- |
| ``base_url`` set | ``embedded`` | an attached server's kind cannot be told from here: say ``vllm`` / ``sglang`` to attach to one |
| replicas on the CPU (no GPU, ``engine_config.device="cpu"``, ``replica_devices`` all ``cpu``) | ``embedded`` | on the CPU it is the fast path (about 2x vLLM's CPU build, BENCHMARKS.md) |
| replicas on GPUs, no vLLM found (``find_vllm_python``) | ``embedded`` | the line says it is the small-model path and how to install vLLM |
| replicas on GPUs, vLLM found, but the config sets what vLLM does not read (``check_backend``) | ``embedded`` | the line names the setting |
| replicas on GPUs, vLLM found | ``vllm`` | the line names the interpreter it launches |

Where vLLM is looked for on a GPU machine: ``engine_python`` when set, else ``.venv-vllm-gpu`` of this repository
(the README's GPU quickstart builds it), else the current interpreter when it can import ``vllm``. The venv of
``scripts/setup_vllm.sh`` (``.venv-vllm``) holds vLLM's CPU build and is never picked for a GPU. "Found" is a look at
the venv's ``site-packages`` (no process is started, nothing is imported), so choosing costs nothing.

Resolved where a run starts (``training/recipes/run.py``), by ``python -m training.memory_plan`` and by
``DeploymentGroup``; before that, ``"auto"`` reads as the embedded backend's facts (``backend``), which is what it
is everywhere without a GPU.
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parents[2]
VLLM_GPU_VENV_PYTHON = REPO_ROOT / ".venv-vllm-gpu" / "bin" / "python"
"""The interpreter of the README's GPU quickstart venv (vLLM's CUDA build beside this package)."""
INSTALL_HINT = "README.md, 'GPU quickstart', builds .venv-vllm-gpu"


@dataclass(frozen=True)
class EngineChoice:
    """What ``engine="auto"`` became: ``name`` (a ``BACKENDS`` name), the vLLM interpreter when it launches vLLM,
    and the start-up ``line`` (None when there is nothing to say: replicas on the CPU, or an explicit engine)."""

    name: str
    engine_python: Optional[str] = None
    line: Optional[str] = None


def venv_has_vllm(python: str | Path) -> bool:
    """Whether the venv of interpreter ``python`` (``<venv>/bin/python``) has a ``vllm`` package installed."""
    venv = Path(python).parent.parent
    return any(p.is_dir() for p in venv.glob("lib/python3*/site-packages/vllm"))


def find_vllm_python(engine_python: Optional[str] = None) -> Optional[str]:
    """The interpreter that would launch a vLLM on GPUs (module docstring, "Where vLLM is looked for"), or None."""
    if engine_python:
        return engine_python
    if VLLM_GPU_VENV_PYTHON.exists() and venv_has_vllm(VLLM_GPU_VENV_PYTHON):
        return str(VLLM_GPU_VENV_PYTHON)
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    return None


def replicas_on_gpu(deploy, num_gpus: int) -> bool:
    """Whether the launched replicas of ``deploy`` would run on GPUs on a machine with ``num_gpus`` of them
    (the placement's rule, training/deployment/placement.py: ``replica_devices``, else ``engine_config.device``,
    else the GPUs when there are any)."""
    if deploy.replica_devices:
        return any(d != "cpu" for d in deploy.replica_devices)
    device = deploy.engine_config.device
    if device != "auto":
        return device.startswith("cuda")
    return num_gpus > 0


def choose_engine(deploy, num_gpus: int, vllm_python: Optional[str] = None) -> EngineChoice:
    """The engine ``deploy`` runs (``deploy.engine`` itself unless it is ``"auto"``), by the module docstring's
    rule; ``vllm_python`` is what ``find_vllm_python`` found (looked up here when None)."""
    from training.utils.config import BACKENDS, ConfigError, check_backend

    if deploy.engine != "auto":
        return EngineChoice(deploy.engine)
    if deploy.base_url is not None or not replicas_on_gpu(deploy, num_gpus):
        return EngineChoice("embedded")
    vllm_python = vllm_python or find_vllm_python(deploy.engine_python)
    small = "the embedded engine: the small-model path on GPUs (its decode is simple; vLLM is faster for larger models)"
    if vllm_python is None:
        return EngineChoice("embedded", line=f"engine auto: {small}; no vLLM found ({INSTALL_HINT})")
    try:
        check_backend(deploy, BACKENDS["vllm"])
    except ConfigError as e:
        return EngineChoice(
            "embedded",
            line=f"engine auto: {small}; vLLM at {vllm_python} is installed but this config sets what it does not "
            f"read ({e}); set deployment.engine=vllm after changing that, or engine=embedded to keep this",
        )
    return EngineChoice(
        "vllm",
        engine_python=vllm_python,
        line=f"engine auto: vLLM, launched by {vllm_python} (replicas on GPUs); deployment.engine=embedded keeps "
        "this package's engine",
    )


def resolve_engine(deploy, num_gpus: Optional[int] = None) -> tuple:
    """``(deploy with a concrete engine, EngineChoice)``; ``num_gpus`` defaults to the GPUs torch sees."""
    if deploy.engine != "auto":
        return deploy, EngineChoice(deploy.engine)
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    choice = choose_engine(deploy, num_gpus)
    resolved = replace(deploy, engine=choice.name, engine_python=deploy.engine_python or choice.engine_python)
    return resolved, choice
