"""The cluster side of a Ray run: connect, reserve the placement groups, say where each bundle landed.

    ray = connect()                                     # ray.init(address="auto"), or RAY_ADDRESS
    pgs = reserve(plan_bundles(spec), run_id, timeout_s)  # refused at start, naming the bundle, if it cannot fit
    bundle_nodes(pgs["replicas"])                       # ["10.0.0.2", "10.0.0.3"]: the node of each bundle

Placement groups are named ``<run_id>-<group>`` in the namespace ``NAMESPACE``, so trainer rank 0 (a process of
its own, connected to the same cluster) finds the replicas' group by name (``training/launch/replicas.py``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Optional, Sequence

from training.launch.bundles import BundleGroup, check_fits
from training.launch.ray_import import import_ray

log = logging.getLogger(__name__)

NAMESPACE = "training"
"""The Ray namespace of every launcher object (placement groups by name)."""
NODE_RESOURCES = ("CPU", "GPU", "memory")


def connect(address: Optional[str] = None) -> Any:
    """Connect to the running cluster (``address``, else ``RAY_ADDRESS``, else ``auto``: the local head) and return
    the ``ray`` module; already connected: returns it. No dashboard, logs of actors to this console."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(
            address=address or os.environ.get("RAY_ADDRESS") or "auto",
            namespace=NAMESPACE,
            log_to_driver=True,
            configure_logging=False,
        )
    return ray


def node_resources(ray: Any) -> list[dict]:
    """The total resources of each live node (Ray's names: ``CPU``, ``GPU``, ``memory``)."""
    return [
        {k: float(v) for k, v in n["Resources"].items() if k in NODE_RESOURCES}
        for n in ray.nodes()
        if n.get("Alive", n.get("alive"))
    ]


def reserve(groups: Sequence[BundleGroup], run_id: str, timeout_s: float) -> dict[str, Any]:
    """Reserve every placement group of ``groups`` (named ``<run_id>-<name>``); wait up to ``timeout_s`` for all.

    Refused at start with ``ValueError`` naming the bundle: by ``check_fits`` on the nodes' totals before asking,
    or when Ray has not placed a group within ``timeout_s`` (then every group reserved is removed)."""
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    check_fits(groups, node_resources(ray))
    made: dict[str, Any] = {}
    try:
        for g in groups:
            made[g.name] = placement_group(list(g.bundles), strategy=g.strategy, name=f"{run_id}-{g.name}")
        deadline = time.monotonic() + timeout_s
        for g in groups:
            left = max(0.1, deadline - time.monotonic())
            if not made[g.name].wait(left):
                raise ValueError(
                    f"ray placement: the cluster did not grant placement group '{g.name}' ({g.strategy}; bundles "
                    f"{', '.join(g.names)}) within {timeout_s:g} s: its nodes are busy or cannot hold that packing "
                    "(`ray status` shows what is free)"
                )
    except BaseException:
        for pg in made.values():
            remove_placement_group(pg)
        raise
    return made


def bundle_nodes(pg: Any) -> list[str]:
    """The node that holds each bundle of placement group ``pg`` (in bundle order), as ``ADDRESS (node ID8)``."""
    ray = import_ray()
    from ray.util import placement_group_table

    table = placement_group_table(pg)
    ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    to_node = table.get("bundles_to_node_id", {})
    return [f"{ips.get(to_node.get(i), '?')} ({to_node.get(i, '?')[:8]})" for i in range(len(table["bundles"]))]


def release(pgs: dict[str, Any]) -> None:
    """Remove the placement groups (their actors are stopped by Ray)."""
    import_ray()
    from ray.util.placement_group import remove_placement_group

    for pg in pgs.values():
        try:
            remove_placement_group(pg)
        except Exception:  # noqa: BLE001 - the cluster is going away too
            pass
