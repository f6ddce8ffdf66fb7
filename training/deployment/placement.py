"""Where each part of a run goes: the trainer's GPUs, the reference model's, each inference replica's.

    placement = plan_placement(cfg.deployment, cfg.trainer)   # DeploymentGroup calls it once, logs it
    placement.replicas[i].visible_devices                      # "1" -> the child's CUDA_VISIBLE_DEVICES
    env = server_env(os.environ, placement.replicas[i])        # torchrun's variables removed

The one decision, made here and nowhere else (GPU indices are this process's ``cuda:N``):

| part | goes to |
| --- | --- |
| trainer | ``TrainerConfig.device``; under torchrun ``cuda`` means ``cuda:LOCAL_RANK``, so this node's trainer ranks hold GPUs ``0..LOCAL_WORLD_SIZE-1``; ``cpu``: no GPU |
| reference model | ``TrainerConfig.reference_device``; ``auto`` = the trainer's device |
| replica ``i`` (``replica_devices`` set) | entry ``i % len(replica_devices)``: ``cpu``, ``cuda:N``, or ``cuda:N,M`` (tensor parallel, a ``multi_gpu`` backend) |
| replica ``i`` (``replica_devices`` empty, ``engine_config.device`` ``cpu`` / ``cuda`` / ``cuda:N``) | that device, for every replica (``cuda`` = ``cuda:0``) |
| replica ``i`` (both ``auto``) | CPU without GPUs; else the GPUs the trainer and reference do not use, spread round-robin; none free: the trainer's GPUs (refused unless ``colocate``) |

A launched server sees only its own GPUs (``CUDA_VISIBLE_DEVICES``, so its engine runs on ``cuda:0``;
a CPU replica sees none) and none of torchrun's variables (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...:
a server is no rank of the trainer's group). Refused at start (``ValueError`` naming the setting): a GPU
that does not exist; a replica on a GPU of the trainer or reference model without ``colocate``; a
replica on several GPUs of a backend that runs on one (``Backend.multi_gpu``: the embedded engine);
replicas sharing a GPU whose memory budgets (``gpu_memory_fraction``, else the backend's
``default_gpu_memory_fraction``; training/utils/backends.py) sum over 1.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Mapping, Optional

from training.utils.backends import BACKENDS
from training.utils.config import DeployConfig, TrainerConfig, backend

log = logging.getLogger(__name__)

TORCHRUN_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_NAME",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
)
"""torchrun's per-rank variables: a launched server must not see them (it would think it is a rank)."""
TORCHRUN_PREFIXES = ("TORCHELASTIC_",)


@dataclass(frozen=True)
class ReplicaPlacement:
    """One replica's devices: ``gpus`` are this process's CUDA indices, empty for a CPU replica."""

    gpus: tuple[int, ...] = ()

    @property
    def label(self) -> str:
        """``cpu`` or ``cuda:N[,M...]`` (a ``DeployConfig.replica_devices`` entry)."""
        return "cuda:" + ",".join(map(str, self.gpus)) if self.gpus else "cpu"

    @property
    def engine_device(self) -> str:
        """The device the server's engine uses: it sees only its own GPUs, so the first is ``cuda:0``."""
        return "cuda:0" if self.gpus else "cpu"

    def visible_devices(self, parent_visible: Optional[str] = None) -> str:
        """The child's ``CUDA_VISIBLE_DEVICES``: its GPUs, mapped through the parent's own
        ``CUDA_VISIBLE_DEVICES`` when that is set (index ``i`` here is entry ``i`` there); "" for CPU."""
        if parent_visible is not None and parent_visible.strip():
            parent = [p.strip() for p in parent_visible.split(",")]
            return ",".join(parent[g] for g in self.gpus)
        return ",".join(map(str, self.gpus))


@dataclass(frozen=True)
class Placement:
    """Where a run's parts go (``plan_placement``)."""

    trainer: tuple[str, ...]
    """One device per trainer rank on this node (``cuda:0``, ``cuda:1``... or ``cpu``)."""
    reference: str
    """The reference model's device (of local rank 0)."""
    replicas: tuple[ReplicaPlacement, ...]
    """One entry per launched replica."""

    def describe(self) -> str:
        trainer = ", ".join(self.trainer) if len(set(self.trainer)) > 1 else self.trainer[0]
        replicas = ", ".join(f"{i}: {r.label}" for i, r in enumerate(self.replicas))
        return f"placement: trainer {trainer}; reference {self.reference}; replicas {replicas}"


def parse_replica_device(value: str) -> ReplicaPlacement:
    """``cpu`` → no GPU; ``cuda:1,2`` → GPUs (1, 2)."""
    return ReplicaPlacement(() if value == "cpu" else tuple(int(i) for i in value[5:].split(",")))


def _gpus_of(device: str, local_ranks: int) -> list[int]:
    """The GPUs a trainer device name takes on this node (``cuda`` under torchrun: one per local rank)."""
    if device == "cpu":
        return []
    if local_ranks > 1:
        return list(range(local_ranks))  # device_for_rank: cuda[:N] means cuda:LOCAL_RANK
    return [int(device[5:])] if device.startswith("cuda:") else [0]


def plan_placement(
    deploy: DeployConfig,
    trainer: Optional[TrainerConfig] = None,
    *,
    num_gpus: Optional[int] = None,
    local_world_size: Optional[int] = None,
) -> Placement:
    """Decide where the trainer, the reference model and each of ``deploy.num_replicas`` replicas go
    (the table of the module docstring). ``num_gpus`` (default: ``torch.cuda.device_count()``) and
    ``local_world_size`` (default: ``LOCAL_WORLD_SIZE``, else 1) describe the machine. Raises
    ``ValueError`` naming the setting of a placement that cannot work."""
    trainer = trainer or TrainerConfig()
    facts = backend(deploy.engine)
    if num_gpus is None:
        import torch

        num_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if local_world_size is None:
        local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))

    def on_machine(device: str) -> str:
        return device if device != "auto" else ("cuda" if num_gpus else "cpu")

    t_device = on_machine(trainer.device)
    r_device = on_machine(trainer.reference_device) if trainer.reference_device != "auto" else t_device
    trainer_gpus = _gpus_of(t_device, local_world_size)
    reference_gpus = _gpus_of(r_device, local_world_size) if trainer.lora_rank == 0 else trainer_gpus
    taken = set(trainer_gpus) | set(reference_gpus)

    if deploy.replica_devices:
        entries = [parse_replica_device(d) for d in deploy.replica_devices]
        setting = "deployment.replica_devices"
    elif deploy.engine_config.device != "auto" or not num_gpus:
        device = on_machine(deploy.engine_config.device)
        entries = [ReplicaPlacement(() if device == "cpu" else (int(device[5:]) if ":" in device else 0,))]
        setting = "deployment.engine_config.device"
    else:
        free = [g for g in range(num_gpus) if g not in taken]
        entries = [ReplicaPlacement((g,)) for g in (free or sorted(taken) or [0])]
        setting = "deployment.replica_devices (empty: the GPUs the trainer does not use)"
    replicas = tuple(entries[i % len(entries)] for i in range(deploy.num_replicas))

    for r in replicas:
        for g in r.gpus:
            if g >= num_gpus:
                have = f"{num_gpus} GPU(s)" if num_gpus else "no GPU (CUDA is not available)"
                raise ValueError(f"{setting}: replica on {r.label}, but this machine has {have}")
        if len(r.gpus) > 1 and not facts.multi_gpu:
            several = " / ".join(b.name for b in BACKENDS.values() if b.multi_gpu)
            raise ValueError(f"{setting}: {r.label}: the {facts.name} engine runs on one GPU (several: {several})")
        shared = sorted(set(r.gpus) & taken)
        if shared and not deploy.colocate:
            raise ValueError(
                f"{setting}: replica on {r.label} shares GPU {shared[0]} with the trainer or reference model "
                f"(trainer {t_device}, reference {r_device}); give the replicas other GPUs "
                "(deployment.replica_devices, or 'cpu') or set deployment.colocate=True"
            )
    _check_memory_budgets(deploy, replicas)
    trainer_devices = tuple(f"cuda:{g}" for g in trainer_gpus) or ("cpu",)
    reference = f"cuda:{reference_gpus[0]}" if reference_gpus else "cpu"
    return Placement(trainer=trainer_devices, reference=reference, replicas=replicas)


def _check_memory_budgets(deploy: DeployConfig, replicas: tuple[ReplicaPlacement, ...]) -> None:
    """Replicas on one GPU must fit: their memory fractions (set or the backend's default) sum to <= 1."""
    facts = backend(deploy.engine)
    if "gpu_memory_fraction" not in facts.memory_settings:
        return  # sized otherwise (the embedded engine: its KV pool takes a share of the memory free at its start)
    fraction = deploy.gpu_memory_fraction or facts.default_gpu_memory_fraction
    if fraction is None:
        return
    per_gpu: dict[int, int] = {}
    for r in replicas:
        for g in r.gpus:
            per_gpu[g] = per_gpu.get(g, 0) + 1
    for g, n in sorted(per_gpu.items()):
        if n * fraction > 1.0 + 1e-9:
            raise ValueError(
                f"deployment.gpu_memory_fraction: {n} {deploy.engine} replicas on GPU {g} take {fraction:g} each "
                f"(sum {n * fraction:g} > 1); lower gpu_memory_fraction to <= {1 / n:.2f} or spread the replicas "
                "(deployment.replica_devices)"
            )


def server_env(env: Mapping[str, str], replica: Optional[ReplicaPlacement]) -> dict[str, str]:
    """The environment of a launched server: ``env`` without torchrun's variables and, for a placed
    replica, ``CUDA_VISIBLE_DEVICES`` set to its own GPUs ("" for a CPU replica)."""
    out = {k: v for k, v in env.items() if k not in TORCHRUN_VARS and not k.startswith(TORCHRUN_PREFIXES)}
    if replica is not None:
        out["CUDA_VISIBLE_DEVICES"] = replica.visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    return out
