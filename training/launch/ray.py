"""``python -m training.launch.ray [flags] train.py [key=value ...]``: one run on a Ray cluster, from its head node.

Phases (``launch``):

1. connect to the running cluster (``ray.init(address="auto")``, or ``--address`` / ``RAY_ADDRESS``);
2. plan and reserve the placement groups (``bundles.py``: trainer ranks packed, replicas spread, or colocated
   bundles), refused at start naming the bundle that cannot fit;
3. check that the shared path (``--shared-path``, default the working directory: where ``log_path``, checkpoints and
   the servers' logs go) is writable from every node that holds a bundle;
4. start one ``TrainerRank`` actor per rank and run ``python train.py ...`` in each with torchrun's variables
   (rank 0's node hosts the rendezvous), so the recipe forms its torch.distributed group (gloo on CPU, NCCL on GPU)
   as under torchrun; trainer rank 0 starts the replicas as actors in the replicas' group (``replicas.py``);
5. wait: every rank exits 0, or the first rank that fails or whose actor is lost stops the others and the run with
   one line; the same command again resumes from the last checkpoint (the recipe's own resume).

Flags are ``RaySpec``'s fields (``bundles.py``) plus ``--address``, ``--shared-path`` and ``--run-id``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import uuid
from typing import Any, Optional, Sequence

from training.launch.bundles import RaySpec, plan_bundles
from training.launch.ray_import import RayMissingError

log = logging.getLogger("training.launch")

EXIT_LOST = 3
"""The launcher's exit code when a trainer rank was lost (its actor or node died)."""


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, RaySpec]:
    from training.utils.cli import field_docs

    p = argparse.ArgumentParser(prog="python -m training.launch.ray", description=__doc__.split("\n")[0])
    p.add_argument("--address", default=None, help="the cluster (default RAY_ADDRESS, else auto: this head node)")
    p.add_argument("--shared-path", default=os.getcwd(), help="a folder every node can write (default: the cwd)")
    p.add_argument("--run-id", default=None, help="names the placement groups (default: a random id)")
    docs = field_docs(RaySpec)
    for f in dataclasses.fields(RaySpec):
        kind = f.type if isinstance(f.type, type) else {"int": int, "float": float, "bool": bool}[str(f.type)]
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            p.add_argument(flag, action="store_true", help=docs.get(f.name, ""))
        else:
            p.add_argument(flag, type=kind, default=f.default, help=docs.get(f.name, ""))
    p.add_argument("script", help="the run's train.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (key=value overrides)")
    args = p.parse_args(list(argv))
    spec = RaySpec(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RaySpec)})
    return args, spec


def trainer_envs(
    wheres: list[dict], world: int, replica_group: str, gcs_address: str, replica_resources: Optional[dict] = None
) -> list[dict]:
    """torchrun's variables for each rank (``wheres[r]``: its ``TrainerRank.where``), plus the launcher's own.

    ``LOCAL_RANK`` counts the ranks on one node in rank order; on GPUs each rank's process sees every GPU Ray gave the
    ranks of its node (``CUDA_VISIBLE_DEVICES``, as torchrun's ranks do), so ``cuda:LOCAL_RANK`` is its own."""
    by_node: dict[str, list[int]] = {}
    for r, w in enumerate(wheres):
        by_node.setdefault(w["node"], []).append(r)
    trainers = json.dumps([{"rank": r, "node": w["label"]} for r, w in enumerate(wheres)])
    envs = []
    for r, w in enumerate(wheres):
        local = by_node[w["node"]]
        env = {
            "RANK": str(r),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(local.index(r)),
            "LOCAL_WORLD_SIZE": str(len(local)),
            "GROUP_RANK": str(list(by_node).index(w["node"])),
            "MASTER_ADDR": wheres[0]["node"],
            "MASTER_PORT": str(wheres[0]["port"]),
            "RAY_ADDRESS": gcs_address,
            "TRAINING_RAY_REPLICA_GROUP": replica_group,
            "TRAINING_RAY_TRAINERS": trainers,
        }
        if replica_resources is not None:
            env["TRAINING_RAY_REPLICA_RESOURCES"] = json.dumps(replica_resources)
        gpus = [g for q in local for g in wheres[q]["gpus"]]
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        envs.append(env)
    return envs


def launch(args: argparse.Namespace, spec: RaySpec) -> int:
    """The phases of the module docstring; returns the exit code (0, the failed rank's, or ``EXIT_LOST``)."""
    from training.launch.trainer_rank import TrainerRank
    from training.launch.ray_cluster import bundle_nodes, connect, release, reserve

    ray = connect(args.address)
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    run_id = args.run_id or f"run-{uuid.uuid4().hex[:8]}"
    groups = plan_bundles(spec)
    pgs = reserve(groups, run_id, spec.placement_timeout_s)
    trainer_pg = pgs.get("trainer", pgs.get("colocated"))
    replica_pg = pgs.get("replicas", pgs.get("colocated"))
    actors: list[Any] = []
    try:
        for g in groups:
            for name, node in zip(g.names, bundle_nodes(pgs[g.name])):
                log.info("ray placement: %s on node %s (group %s-%s, %s)", name, node, run_id, g.name, g.strategy)
        check_shared_path(ray, args.shared_path, pgs)
        for r in range(spec.trainer_ranks):
            actors.append(
                ray.remote(TrainerRank)
                .options(
                    num_cpus=spec.trainer_cpus,
                    num_gpus=spec.trainer_gpus,
                    memory=int(spec.trainer_memory_gb * 2**30) or None,
                    max_concurrency=2,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=trainer_pg, placement_group_bundle_index=r
                    ),
                )
                .remote()
            )
        wheres = ray.get([a.where.remote() for a in actors])
        for r, w in enumerate(wheres):
            log.info(
                "trainer rank %d: actor pid %d on node %s, GPUs [%s]", r, w["pid"], w["label"], ",".join(w["gpus"])
            )
        gcs = ray.get_runtime_context().gcs_address
        replica = plan_bundles(dataclasses.replace(spec, colocate=False))[1].bundles[0]  # one replica's own share
        envs = trainer_envs(wheres, spec.trainer_ranks, f"{run_id}-{replica_pg_name(pgs)}", gcs, replica)
        argv = [os.path.abspath(args.script), *args.script_args]
        refs = [a.run.remote(argv, env, args.shared_path) for a, env in zip(actors, envs)]
        return wait_ranks(ray, refs, actors, wheres)
    finally:
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - gone already
                pass
        release(pgs)
        del replica_pg


def replica_pg_name(pgs: dict) -> str:
    return "replicas" if "replicas" in pgs else "colocated"


def check_shared_path(ray: Any, path: str, pgs: dict) -> None:
    """Refuse at start (``OSError`` naming the node) when ``path`` is not writable from a node holding a bundle."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from training.launch.node import check_writable

    probe = ray.remote(num_cpus=0)(check_writable)
    refs = [
        probe.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=i)
        ).remote(path)
        for pg in pgs.values()
        for i in range(len(pg.bundle_specs))
    ]
    try:
        nodes = sorted(set(ray.get(refs)))
    except ray.exceptions.RayTaskError as e:
        raise OSError(str(e.cause) if getattr(e, "cause", None) else str(e)) from None
    log.info("shared path %s: writable from every node (%s)", path, ", ".join(nodes))


def wait_ranks(ray: Any, refs: list, actors: list, wheres: list[dict]) -> int:
    """Wait for every rank; the first that fails or is lost stops the others. Returns the run's exit code."""
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        r = refs.index(done[0])
        try:
            code = ray.get(done[0])
        except ray.exceptions.RayActorError:
            log.error(
                "trainer rank %d on node %s was lost (its actor or node died): the run stops. The same command "
                "again resumes it from its last checkpoint.",
                r,
                wheres[r]["label"],
            )
            stop_ranks(ray, actors, r)
            return EXIT_LOST
        if code != 0:
            log.error("trainer rank %d on node %s exited with code %d: the run stops", r, wheres[r]["label"], code)
            stop_ranks(ray, actors, r)
            return code
    log.info("every trainer rank finished")
    return 0


def stop_ranks(ray: Any, actors: list, failed: int) -> None:
    """SIGTERM every other rank's process (they unwind as on Ctrl-C)."""
    for i, a in enumerate(actors):
        if i != failed:
            try:
                ray.get(a.terminate.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - lost too
                pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        args, spec = parse_args(sys.argv[1:] if argv is None else argv)
        return launch(args, spec)
    except (RayMissingError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
