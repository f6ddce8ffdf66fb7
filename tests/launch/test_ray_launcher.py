"""The Ray launcher on a real multi-node Ray cluster on one host (``ray.cluster_utils.Cluster``: a head and two more
raylets, each with CPUs of its own), on the default example and the tiny model.

One cluster for the module: an unschedulable run is refused at start naming its bundle; then one run with 2 trainer
ranks packed on one node and 2 embedded replicas spread over the others, weights pushed over the distributed path,
one replica's actor killed (SIGKILL of its process) mid-run. The run finishes, every step trains each of its rows once,
the replaced replica's new place is logged, and the loss curve is that of a one-machine run of the same seed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the ray extra (pip install 'training[ray]'; scripts/setup.sh installs it)")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "training" / "examples" / "rl" / "single_turn_token_in"
STEPS = 4
RUN_ARGS = [
    f"max_steps={STEPS}",
    "eval_interval=0",
    "dcp_save_interval=0",
    "prompt_groups_per_step=4",
    "completions_per_prompt=4",
    "synchronous_training=true",
    "max_head_offpolicy_versions=0",
    "learning_rate=2e-5",
    "deployment.num_replicas=2",
    "deployment.engine_config.enable_prefix_caching=false",
    "deployment.engine_config.num_threads=1",
    "trainer.device=cpu",
]
LAUNCH = [sys.executable, "-m", "training.launch.ray"]


@pytest.fixture(scope="module")
def cluster():
    """A head without CPUs (the launcher's driver only) and three nodes: one of 2 CPUs for the trainer ranks, two
    of 1 CPU for the replicas."""
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    for cpus in (2, 1, 1):
        c.add_node(num_cpus=cpus)
    c.wait_for_nodes()
    yield c
    c.shutdown()


def _env(cluster) -> dict:
    return {**os.environ, "RAY_ADDRESS": cluster.address, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def _rows(log_path: Path) -> list[dict]:
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/loss" in r]


def _curves(log_path: Path) -> tuple[list[float], list[float]]:
    """The loss and grad-norm curves of a run."""
    rows = _rows(log_path)
    return [r["train/loss"] for r in rows], [r["train/grad_norm"] for r in rows]


@pytest.mark.slow
def test_a_placement_the_cluster_cannot_hold_or_a_shared_path_a_node_cannot_write_is_refused(cluster, tmp_path):
    done = subprocess.run(
        [*LAUNCH, "--replica-gpus", "1", "--shared-path", str(tmp_path), str(EXAMPLE / "train.py")],
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert "bundle 'replica 0' (CPU=1, GPU=1) fits on no node" in done.stderr

    taken = tmp_path / "a-file"  # a shared path no node can make a folder of
    taken.write_text("")
    done = subprocess.run(
        [*LAUNCH, "--shared-path", str(taken), str(EXAMPLE / "train.py")],
        env=_env(cluster),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr[-3000:]
    assert re.search(rf"error: shared path {taken}: not writable from node \S+ \(\w+\)", done.stderr), done.stderr


@pytest.mark.slow
def test_two_ranks_and_two_spread_replicas_survive_a_lost_replica_and_match_one_machine(cluster, tmp_path):
    single = tmp_path / "single"  # the one-machine run of the same seed, beside the Ray run (its start-up is waiting)
    one = subprocess.Popen(
        [sys.executable, "train.py", f"log_path={single}", *RUN_ARGS],
        cwd=EXAMPLE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.DEVNULL,
        stderr=open(tmp_path / "single.log", "w"),
    )

    multi = tmp_path / "multi"
    out = tmp_path / "launcher.log"
    with open(out, "w") as fh:
        proc = subprocess.Popen(
            [*LAUNCH, "--trainer-ranks", "2", "--replicas", "2", "--shared-path", str(tmp_path)]
            + [str(EXAMPLE / "train.py"), f"log_path={multi}", *RUN_ARGS],
            env=_env(cluster),
            stdout=fh,
            stderr=subprocess.STDOUT,
            text=True,
        )
    killed = None
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        text = out.read_text()
        pids = re.findall(r"replica 1: embedded server at (\S+) on node (\S+ \(\w+\)) \(Ray actor pid (\d+)\)", text)
        metrics = multi / "metrics.jsonl"
        if killed is None and pids and metrics.exists() and _rows(multi):
            killed = pids[0]
            os.kill(int(killed[2]), signal.SIGKILL)  # the replica's actor process: Ray sees the actor die
        time.sleep(0.2)
    rc = proc.wait(timeout=60)
    text = out.read_text()
    assert rc == 0, text[-5000:]
    assert one.wait(timeout=300) == 0, (tmp_path / "single.log").read_text()[-3000:]
    assert killed is not None, "the run ended before a replica could be killed"
    print(text[-3000:])

    # placement: both ranks on the 2-CPU node, the replicas on the two others (nodes named by their id)
    nodes = dict(re.findall(r"ray placement: (trainer rank \d|replica \d) on node \S+ \((\w+)\)", text))
    assert nodes["trainer rank 0"] == nodes["trainer rank 1"], nodes
    assert len({nodes["trainer rank 0"], nodes["replica 0"], nodes["replica 1"]}) == 3, nodes
    assert "shared path" in text and "writable from every node" in text
    moved = re.findall(
        r"replica 1: embedded server at (\S+) on node (\S+ \(\w+\)) \(Ray actor pid (\d+)\) \(a new actor", text
    )
    assert moved and moved[0][2] != killed[2], "the log does not say where the new replica went"

    # every replica, the new one included, served the final weights (version STEPS) at the end
    final = dict(re.findall(r"replica (\d) on node .* stops at weight version (\S+)", text))
    assert final == {"0": str(STEPS), "1": str(STEPS)}, final

    # every row of every step trained once: (step, row position, completion) unique, the same set as one machine
    def keys(log_path):
        rows = [json.loads(line) for line in (log_path / "rollouts.jsonl").read_text().splitlines()]
        return sorted((r["step"], r["row_position"], r["completion"]) for r in rows)

    assert keys(multi) == keys(single) and len(set(keys(multi))) == len(keys(multi))

    # the curves of 2 ranks on Ray and of 1 process: the world-size tolerance of tests/trainer/test_distributed.py
    (loss_1, grad_1), (loss_2, grad_2) = _curves(single), _curves(multi)
    print("1 machine:", loss_1, grad_1, "\non Ray:", loss_2, grad_2)
    assert len(grad_1) == len(grad_2) == STEPS
    assert sum(g > 1e-3 for g in grad_1) >= 2  # steps with a gradient that could differ (the tiny model's reward
    # spread ends after two steps of this example)
    for a, b in zip(loss_1, loss_2):
        assert a == pytest.approx(b, rel=1e-4, abs=1e-6)
    for a, b in zip(grad_1, grad_2):
        assert a == pytest.approx(b, rel=1e-4)


@pytest.mark.slow
def test_a_lost_trainer_rank_stops_the_run_and_the_same_command_resumes_it(cluster, tmp_path):
    run = tmp_path / "run"
    command = [*LAUNCH, "--trainer-ranks", "2", "--replicas", "1", "--shared-path", str(tmp_path)]
    command += [str(EXAMPLE / "train.py"), f"log_path={run}", "max_steps=2", "dcp_save_interval=1", "eval_interval=0"]
    command += ["prompt_groups_per_step=2", "completions_per_prompt=2", "trainer.device=cpu"]
    out = tmp_path / "launcher.log"
    with open(out, "w") as fh:
        proc = subprocess.Popen(command, env=_env(cluster), stdout=fh, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 180
    latest = run / "checkpoints" / "latest"
    pid = None
    while proc.poll() is None and time.time() < deadline and not (pid and latest.exists()):
        found = re.findall(r"trainer rank 1: actor pid (\d+) on node", out.read_text())
        pid = int(found[0]) if found else None
        time.sleep(0.05)
    assert pid is not None and latest.exists(), out.read_text()[-3000:]
    os.kill(pid, signal.SIGKILL)  # rank 1's actor process: as if its node went away
    rc = proc.wait(timeout=120)
    text = out.read_text()
    assert rc == 3, text[-3000:]
    assert re.search(
        r"trainer rank 1 on node \S+ \(\w+\) was lost .*: the run stops\. The same command again resumes", text
    )
    assert len(_rows(run)) < 2, "the run was not stopped before its end"

    again = subprocess.run(command, env=_env(cluster), capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert re.search(r"resumed from \S+ at step 1\b", again.stdout + again.stderr)
    assert [r["step"] for r in _rows(run)][-1] == 1  # the run reached its last step
