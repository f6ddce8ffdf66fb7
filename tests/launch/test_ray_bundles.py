"""The Ray launcher's plan and refusals, without a cluster: the bundles a run reserves, the bundle a cluster cannot
hold named at start, torchrun's variables per rank, and the one line a missing ``ray`` package gives."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from training.launch.bundles import RaySpec, check_fits, plan_bundles
from training.launch.ray import trainer_envs
from training.launch.ray_import import MISSING_RAY

GIB = 2.0**30


def test_trainer_ranks_are_packed_and_replicas_spread_each_with_its_own_needs():
    groups = plan_bundles(RaySpec(trainer_ranks=2, trainer_gpus=1, replicas=3, replica_cpus=2, replica_memory_gb=4))
    assert [(g.name, g.strategy) for g in groups] == [("trainer", "PACK"), ("replicas", "SPREAD")]
    assert groups[0].bundles == ({"CPU": 1.0, "GPU": 1.0},) * 2
    assert groups[1].bundles == ({"CPU": 2.0, "memory": 4 * GIB},) * 3
    assert groups[1].names == ("replica 0", "replica 1", "replica 2")


def test_colocated_bundles_hold_a_rank_and_its_replica():
    [g] = plan_bundles(RaySpec(trainer_ranks=2, trainer_gpus=1, replicas=2, replica_cpus=2, colocate=True))
    assert (g.name, g.strategy, g.bundles) == ("colocated", "PACK", ({"CPU": 3.0, "GPU": 1.0},) * 2)
    with pytest.raises(ValueError, match=r"replicas: colocate pairs .* \(3\) must equal trainer_ranks \(2\)"):
        RaySpec(trainer_ranks=2, replicas=3, colocate=True)


def test_a_bundle_no_node_can_hold_is_refused_by_name():
    nodes = [{"CPU": 8.0, "GPU": 2.0}, {"CPU": 4.0}]
    check_fits(plan_bundles(RaySpec(trainer_ranks=2, trainer_gpus=1, replicas=2)), nodes)  # fits
    with pytest.raises(ValueError, match=r"bundle 'replica 0' \(CPU=1, GPU=4\) fits on no node"):
        check_fits(plan_bundles(RaySpec(replicas=2, replica_gpus=4)), nodes)
    with pytest.raises(ValueError, match=r"bundle 'replica 0' \(CPU=1, GPU=1\) does not fit: .* GPU=3 .* GPU=2"):
        check_fits(plan_bundles(RaySpec(trainer_ranks=2, trainer_gpus=1, replicas=2, replica_gpus=1)), nodes)


def test_each_rank_gets_torchruns_variables_with_local_ranks_per_node():
    wheres = [
        {"node": "10.0.0.1", "label": "10.0.0.1 (a)", "port": 29500, "gpus": ["0"]},
        {"node": "10.0.0.1", "label": "10.0.0.1 (a)", "port": 1, "gpus": ["1"]},
        {"node": "10.0.0.2", "label": "10.0.0.2 (b)", "port": 2, "gpus": ["3"]},
    ]
    envs = trainer_envs(wheres, 3, "run-replicas", "10.0.0.1:6379")
    assert [(e["RANK"], e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"], e["GROUP_RANK"]) for e in envs] == [
        ("0", "0", "2", "0"),
        ("1", "1", "2", "0"),
        ("2", "0", "1", "1"),
    ]
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"], e["WORLD_SIZE"]) for e in envs} == {("10.0.0.1", "29500", "3")}
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0,1", "0,1", "3"]  # as torchrun: the node's ranks' GPUs
    assert envs[2]["TRAINING_RAY_REPLICA_GROUP"] == "run-replicas"


def test_without_ray_the_launcher_says_which_extra_in_one_line(tmp_path):
    blocked = "import sys; sys.modules['ray'] = None; from training.launch.ray import main; sys.exit(main(['t.py']))"
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"error: {MISSING_RAY}"]
    assert "pip install 'training[ray]'" in MISSING_RAY


def test_a_colocated_replica_takes_only_its_own_share_of_the_bundle():
    spec = RaySpec(trainer_ranks=1, trainer_cpus=2, replicas=1, replica_cpus=1, replica_gpus=1, colocate=True)
    replica = plan_bundles(RaySpec(replica_cpus=1, replica_gpus=1))[1].bundles[0]
    [env] = trainer_envs([{"node": "n", "label": "n (a)", "port": 1, "gpus": []}], 1, "g", "a:1", replica)
    assert json.loads(env["TRAINING_RAY_REPLICA_RESOURCES"]) == {"CPU": 1.0, "GPU": 1.0}
    assert plan_bundles(spec)[0].bundles == ({"CPU": 3.0, "GPU": 1.0},)  # the bundle holds both shares


def test_the_readmes_ray_commands_parse():
    """The launcher commands of the README's and the multi-node skill's Ray sections name flags that exist and a spec
    that validates (the cluster they need is not here; tests/launch/test_ray_launcher.py runs the same shape)."""
    import shlex
    from pathlib import Path

    from training.launch.ray import parse_args

    root = Path(__file__).resolve().parents[2]
    commands = []
    for doc in (root / "README.md", root / "skills" / "multi-node" / "SKILL.md"):
        text = doc.read_text().replace("\\\n", " ")
        commands += [line for line in text.splitlines() if "python -m training.launch.ray --trainer-ranks" in line]
    assert len(commands) == 2, commands
    for line in commands:
        argv = shlex.split(line.split("python -m training.launch.ray", 1)[1].split("  #")[0])
        args, spec = parse_args(argv)
        assert spec.trainer_ranks == 8 and spec.replica_gpus == 1 and args.script.endswith("train.py")
