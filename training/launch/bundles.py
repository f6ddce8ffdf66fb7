"""What a run reserves on a Ray cluster: one bundle per trainer rank and per inference replica.

    spec = RaySpec(trainer_ranks=2, replicas=2, replica_cpus=1)
    groups = plan_bundles(spec)                    # [BundleGroup("trainer", PACK, ...), BundleGroup("replicas", SPREAD, ...)]
    check_fits(groups, node_resources)             # ValueError naming the first bundle no node can hold

The one decision, made here and nowhere else:

| ``colocate`` | placement groups | strategy |
| --- | --- | --- |
| False | ``trainer``: one bundle per rank; ``replicas``: one bundle per replica | trainer ``PACK`` (ranks on as few nodes as fit: the gradient all-reduce stays local), replicas ``SPREAD`` (one per node where possible: a lost node costs one replica) |
| True | ``colocated``: bundle ``i`` holds trainer rank ``i``'s and replica ``i``'s resources | ``PACK``: each bundle is one node's share, the replica beside its rank (``DeployConfig.colocate``) |

A bundle's resources are Ray's names: ``CPU``, ``GPU`` and ``memory`` (bytes); a resource of 0 is left out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence


@dataclass
class RaySpec:
    """How many trainer ranks and replicas a Ray run has and what each needs (the launcher's flags)."""

    trainer_ranks: int = 1
    """Trainer processes (torch.distributed ranks: NCCL on GPUs, gloo on CPU)."""
    trainer_cpus: float = 1.0
    """CPUs one trainer rank reserves."""
    trainer_gpus: float = 0.0
    """GPUs one trainer rank reserves (0: the trainer runs on CPU)."""
    trainer_memory_gb: float = 0.0
    """Memory one trainer rank reserves in GiB (0: not reserved)."""
    replicas: int = 1
    """Inference servers (``deployment.num_replicas`` of the run), each a Ray actor on its node."""
    replica_cpus: float = 1.0
    """CPUs one replica reserves."""
    replica_gpus: float = 0.0
    """GPUs one replica reserves (a vLLM / SGLang replica with tensor parallel K: K)."""
    replica_memory_gb: float = 0.0
    """Memory one replica reserves in GiB (0: not reserved)."""
    colocate: bool = False
    """One bundle per (trainer rank, replica) pair instead of two placement groups (replicas == trainer_ranks)."""
    placement_timeout_s: float = 60.0
    """How long to wait for the cluster to grant the placement groups before the run is refused."""

    def __post_init__(self):
        for name in ("trainer_ranks", "replicas"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")
        for name in ("trainer_cpus", "trainer_gpus", "trainer_memory_gb", "replica_cpus", "replica_gpus"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if self.replica_memory_gb < 0:
            raise ValueError(f"replica_memory_gb: must be >= 0, got {self.replica_memory_gb!r}")
        if self.colocate and self.replicas != self.trainer_ranks:
            raise ValueError(
                f"replicas: colocate pairs each replica with a trainer rank, so replicas ({self.replicas}) must equal "
                f"trainer_ranks ({self.trainer_ranks})"
            )
        if self.placement_timeout_s <= 0:
            raise ValueError(f"placement_timeout_s: must be > 0, got {self.placement_timeout_s!r}")


@dataclass(frozen=True)
class BundleGroup:
    """One placement group: its name, Ray strategy and bundles (``names[i]`` labels ``bundles[i]``)."""

    name: str
    strategy: str
    bundles: tuple[dict, ...]
    names: tuple[str, ...] = field(default=())


def _resources(cpus: float, gpus: float, memory_gb: float) -> dict:
    out = {"CPU": float(cpus), "GPU": float(gpus), "memory": float(memory_gb) * 2**30}
    return {k: v for k, v in out.items() if v > 0}


def _add(a: Mapping[str, float], b: Mapping[str, float]) -> dict:
    return {k: a.get(k, 0.0) + b.get(k, 0.0) for k in set(a) | set(b)}


def plan_bundles(spec: RaySpec) -> list[BundleGroup]:
    """The placement groups of a run (the table of the module docstring)."""
    trainer = _resources(spec.trainer_cpus, spec.trainer_gpus, spec.trainer_memory_gb)
    replica = _resources(spec.replica_cpus, spec.replica_gpus, spec.replica_memory_gb)
    if spec.colocate:
        n = spec.trainer_ranks
        return [
            BundleGroup(
                "colocated",
                "PACK",
                tuple(_add(trainer, replica) for _ in range(n)),
                tuple(f"trainer rank {i} + replica {i}" for i in range(n)),
            )
        ]
    return [
        BundleGroup(
            "trainer",
            "PACK",
            tuple(dict(trainer) for _ in range(spec.trainer_ranks)),
            tuple(f"trainer rank {i}" for i in range(spec.trainer_ranks)),
        ),
        BundleGroup(
            "replicas",
            "SPREAD",
            tuple(dict(replica) for _ in range(spec.replicas)),
            tuple(f"replica {i}" for i in range(spec.replicas)),
        ),
    ]


def _describe(resources: Mapping[str, float]) -> str:
    parts = []
    for k, v in sorted(resources.items()):
        parts.append(f"{k}={v / 2**30:g}GiB" if k == "memory" else f"{k}={v:g}")
    return ", ".join(parts) or "nothing"


def check_fits(groups: Sequence[BundleGroup], nodes: Sequence[Mapping[str, float]]) -> None:
    """Raise ``ValueError`` naming the first bundle that cannot be placed on the cluster's ``nodes`` (each node's
    total resources, Ray's names), placing bundles first-fit in order on what the earlier ones left. A first-fit
    miss can be a packing the cluster could still find; Ray's own wait (``placement_timeout_s``) is the final word,
    so this only refuses what no node could ever hold or what the whole cluster lacks."""
    free = [dict(n) for n in nodes]
    totals: dict[str, float] = {}
    for n in nodes:
        totals = _add(totals, n)
    need: dict[str, float] = {}
    for g in groups:
        for b, name in zip(g.bundles, g.names):
            need = _add(need, b)
            if not any(all(n.get(k, 0.0) >= v - 1e-9 for k, v in b.items()) for n in nodes):
                raise ValueError(
                    f"ray placement: bundle '{name}' ({_describe(b)}) fits on no node of the cluster "
                    f"(nodes: {'; '.join(_describe(n) for n in nodes) or 'none'}); lower what it asks for "
                    "(--trainer-gpus, --replica-gpus, ...) or add a node that has it"
                )
            for k, v in need.items():
                if v > totals.get(k, 0.0) + 1e-9:
                    raise ValueError(
                        f"ray placement: bundle '{name}' ({_describe(b)}) does not fit: the run asks for {k}={v:g} "
                        f"in all up to it and the cluster has {k}={totals.get(k, 0.0):g}"
                    )
            for n in free:  # first fit, to leave the next bundles what is left
                if all(n.get(k, 0.0) >= v - 1e-9 for k, v in b.items()):
                    for k, v in b.items():
                        n[k] = n.get(k, 0.0) - v
                    break
