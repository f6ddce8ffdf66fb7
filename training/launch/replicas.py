"""Inference replicas as Ray actors: ``RayReplica`` is the ``ServerProcess`` of a server that runs in a
``ServerActor`` on some node, so ``DeploymentGroup`` (its sampler's readiness, its restart-aware pushes) drives it as
it drives a local child.

    cfg, replicas = ray_deployment(model_path, cfg.deployment, log_path)   # on trainer rank 0; None off Ray
    DeploymentGroup(model_path, cfg, log_dir=log_path, replicas=replicas).start(tokenizer)

- **Where.** Replica ``i`` is scheduled into bundle ``i`` of the run's replica placement group (``ray.py`` reserved
  it; ``SPREAD``, or the colocated group); its log says the node, ``<log_path>/deployment-<i>.log`` on that node
  (a path every node reaches).
- **Weights.** ``weight_sync`` ``auto`` becomes ``distributed`` (the trainer's rank 0 hosts the group at its own
  node address; the servers accept it as a ``--weight-peer``); ``shm`` is refused (another node has no access to
  this node's /dev/shm); ``disk`` is taken as given (the folder must then be on a shared filesystem).
- **A dead actor** (its node lost, or killed) is seen by the watchdog of ``ServerProcess`` (``poll`` below never
  blocks: it asks whether the actor's ``wait_exit`` reference failed). The restart makes a new actor in the same
  bundle (Ray moves a bundle of a lost node to a node with the resources), logs where it went, moves the sampler
  and the weight group to its new URL (``DeploymentGroup.replica_moved``), and reports ``restarting`` until the next
  push has loaded the latest weights into it, so requests go to the other replicas meanwhile (``weights_arrived``).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import secrets
import time
from typing import Any, Callable, Optional

from training.deployment.backends.process import DeploymentStartError, ServerProcess
from training.deployment.client import ReplicaStatus
from training.launch.node import node_address
from training.launch.server_actor import ServerActor
from training.launch.ray_cluster import connect
from training.utils.config import ConfigError, DeployConfig

log = logging.getLogger(__name__)

ENV_REPLICA_GROUP = "TRAINING_RAY_REPLICA_GROUP"
"""Set by the launcher on every trainer rank: the name of the replicas' placement group."""
ENV_TRAINERS = "TRAINING_RAY_TRAINERS"
"""Set by the launcher on every trainer rank: JSON list of ``{"rank", "node"}`` (logged by rank 0)."""
ENV_REPLICA_RESOURCES = "TRAINING_RAY_REPLICA_RESOURCES"
"""Set by the launcher on every trainer rank: JSON ``{"CPU", "GPU", "memory"}`` one replica's actor takes from its
bundle (a colocated bundle also holds its trainer rank's share)."""


class _ActorExit:
    """The ``_proc`` of a ``RayReplica``: ``poll()`` is None while the actor lives, 1 once it died (non-blocking)."""

    def __init__(self, ray: Any, ref: Any, pid: int):
        self._ray, self._ref, self.pid = ray, ref, pid

    def poll(self) -> Optional[int]:
        done, _ = self._ray.wait([self._ref], timeout=0)
        return 1 if done else None


class RayReplica(ServerProcess):
    """A replica served by a ``ServerActor`` in bundle ``bundle_index`` of placement group ``placement_group``."""

    guard_parent = False

    def __init__(
        self,
        model: str,
        cfg: DeployConfig,
        *,
        placement_group: Any,
        bundle_index: int,
        log_file: str,
        resources: Optional[dict] = None,
    ):
        super().__init__(model, cfg, log_file=log_file)
        self.resources = dict(resources if resources is not None else placement_group.bundle_specs[bundle_index])
        """What the actor takes from its bundle (Ray's names: ``CPU``, ``GPU``, ``memory``)."""
        self.engine = cfg.engine
        self.placement = None  # Ray sets CUDA_VISIBLE_DEVICES for the actor's GPUs
        self.placement_group = placement_group
        self.bundle_index = bundle_index
        self.node: Optional[str] = None
        """The address of the node the server runs on (None before the first start)."""
        self.on_moved: Optional[Callable[[str, str], None]] = None
        """Called with (old URL, new URL) when a restart put the server elsewhere (``DeploymentGroup.replica_moved``)."""
        self._url: Optional[str] = None
        self._actor: Any = None
        self._had_weights = False
        self._awaiting_weights = False
        self._starting: Any = None
        self._started_at = 0.0
        """The ``start`` reference of an actor created by ``prestart``, not yet waited for."""

    @property
    def base_url(self) -> str:
        return self._url or f"http://ray-replica-{self.bundle_index}.invalid"

    def status(self) -> Optional[ReplicaStatus]:
        """``restarting`` also while a restarted replica waits for the push that brings the latest weights."""
        status = super().status()
        if status is not None and status.state == "ready" and self._awaiting_weights:
            return ReplicaStatus("restarting", budget_s=self.restart_wait_s, reason="waiting for the next weight push")
        return status

    def weights_arrived(self, weight_version: int) -> None:
        self._had_weights = True
        self._awaiting_weights = False

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def prestart(self) -> None:
        """Create this replica's actor and ask it to start, without waiting: ``ray_deployment`` starts every replica
        at once (``DeploymentGroup.start`` then waits for each in turn)."""
        if self._actor is None:
            self._create_actor()

    def _create_actor(self) -> None:
        ray = connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.resources
        actor_cls = ray.remote(ServerActor).options(
            num_cpus=bundle.get("CPU", 0),
            num_gpus=bundle.get("GPU", 0),
            memory=int(bundle["memory"]) if bundle.get("memory") else None,
            max_concurrency=4,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=self.bundle_index
            ),
        )
        self._actor = actor_cls.remote(self.model, self.cfg, str(self.log_path), [node_address()])
        self._starting = self._actor.start.remote()
        self._started_at = time.monotonic()

    def _spawn_and_wait(self) -> None:
        """Start a ``ServerActor`` in this replica's bundle (or take the one ``prestart`` made) and wait for its
        server (``startup_timeout_s``)."""
        ray = connect()
        if self._starting is None:
            self._create_actor()
        starting, self._starting, t0 = self._starting, None, self._started_at
        try:
            where = ray.get(starting, timeout=self.cfg.startup_timeout_s)
        except Exception as e:  # noqa: BLE001 - the actor's error names what failed
            ray.kill(self._actor)
            self._actor = None
            raise DeploymentStartError(
                f"{self.engine} replica {self.bundle_index} (Ray actor) did not start: {e}; its log: {self.log_path}",
                summary=f"the {self.engine} replica {self.bundle_index} did not start (its log: {self.log_path})",
            ) from None
        self._proc = _ActorExit(ray, self._actor.wait_exit.remote(), where["pid"])
        old, self._url, moved = self._url, where["url"], self.node is not None
        self.node = where["node"]
        self.startup_s = time.monotonic() - t0
        self.slowest_startup_s = max(self.startup_s, self.slowest_startup_s or 0.0)
        log.info(
            "replica %d: %s server at %s on node %s (Ray actor pid %d)%s",
            self.bundle_index,
            self.engine,
            self._url,
            self.node,
            where["pid"],
            " (a new actor after the old one was lost)" if moved else "",
        )
        if moved:
            self._awaiting_weights = self._had_weights and self.cfg.weight_sync == "distributed"
            if old != self._url and self.on_moved is not None:
                self.on_moved(old, self._url)

    def _terminate(self) -> None:
        actor, self._actor, self._proc = self._actor, None, None
        if actor is None:
            return
        if self._stopping.is_set():  # the run's end: say which weights it served last
            status, text = self._http("GET", "/weight_version", timeout=5.0)
            version = json.loads(text).get("weight_version") if status == 200 else None
            log.info("replica %d on node %s stops at weight version %s", self.bundle_index, self.node, version)
        ray = connect()
        try:
            ray.get(actor.stop.remote(), timeout=self.stop_grace_s)
        except Exception:  # noqa: BLE001 - dead already, or stuck: killed below
            pass
        ray.kill(actor)


def under_ray() -> bool:
    """True in a trainer rank the Ray launcher started (``ENV_REPLICA_GROUP`` is set)."""
    return bool(os.environ.get(ENV_REPLICA_GROUP))


def ray_deployment(model: str, cfg: DeployConfig, log_dir: str) -> tuple[DeployConfig, list[RayReplica]]:
    """The deployment config and the (not yet started) replicas of a run under the Ray launcher: one per bundle of
    its replicas' placement group (the module docstring says what changes in ``cfg``). Logs where each trainer rank
    runs."""
    if cfg.base_url is not None:
        raise ConfigError("deployment.base_url: the Ray launcher starts the replicas itself; leave base_url unset")
    if cfg.weight_sync == "shm":
        raise ConfigError(
            "deployment.weight_sync: 'shm' reaches servers on this node only; under Ray use 'distributed' (or 'auto')"
        )
    connect()
    from ray.util import get_placement_group

    for t in json.loads(os.environ.get(ENV_TRAINERS, "[]")):
        log.info("trainer rank %d: node %s", t["rank"], t["node"])
    pg = get_placement_group(os.environ[ENV_REPLICA_GROUP])
    n = len(pg.bundle_specs)
    if cfg.num_replicas not in (1, n):
        log.warning("deployment.num_replicas=%d: the Ray launcher reserved %d replicas; %d run", cfg.num_replicas, n, n)
    cfg = dataclasses.replace(
        cfg,
        num_replicas=n,
        api_key=cfg.api_key or secrets.token_urlsafe(24),  # the servers bind their node's address: a key is required
        weight_sync="distributed" if cfg.weight_sync == "auto" else cfg.weight_sync,
        weight_sync_master_addr=cfg.weight_sync_master_addr or node_address(),
    )
    from training.deployment.group import replica_config

    replicas = [
        RayReplica(
            model,
            replica_config(cfg, i),
            placement_group=pg,
            bundle_index=i,
            log_file=os.path.join(log_dir, f"deployment-{i}.log"),
            resources=json.loads(os.environ[ENV_REPLICA_RESOURCES]) if os.environ.get(ENV_REPLICA_RESOURCES) else None,
        )
        for i in range(n)
    ]
    for r in replicas:
        r.prestart()
    return cfg, replicas
