"""Device placement (training/deployment/placement.py) and the GPU defaults, checked on the CPU: where
replicas go, the environment each launched server gets, placements refused at start, vLLM's flags and
interpreter per device, SGLang's config.json for hub ids, the exit barrier's group, the CPU suite's pin."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import selects_only_gpu_tests
from training.deployment.backends.embedded import EmbeddedDeployment
from training.deployment.group import DeploymentGroup
from training.deployment.placement import TORCHRUN_VARS, ReplicaPlacement, plan_placement, server_env
from training.deployment.client import DeploymentSampler
from training.deployment.backends.sglang import SGLangDeployment
from training.deployment.backends.vllm import VLLM_VENV_PYTHON, VLLMDeployment
from training.utils import dist as dist_utils
from training.utils.config import DeployConfig, EngineConfig, TrainerConfig
from training.utils.http import free_port

FAKE_TORCHRUN = {
    "RANK": "0",
    "LOCAL_RANK": "0",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "ROLE_RANK": "0",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29999",
    "TORCHELASTIC_RUN_ID": "fake",
    "TORCHELASTIC_RESTART_COUNT": "0",
}


def labels(cfg: DeployConfig, trainer: TrainerConfig | None = None, **kw) -> list[str]:
    return [r.label for r in plan_placement(cfg, trainer, **kw).replicas]


# ----------------------------------------------------------------------- where replicas go
def test_replicas_spread_over_the_listed_devices_and_each_child_sees_only_its_own():
    cfg = DeployConfig(num_replicas=4, replica_devices=["cuda:1", "cuda:2"])
    placement = plan_placement(cfg, num_gpus=3)
    assert [r.label for r in placement.replicas] == ["cuda:1", "cuda:2", "cuda:1", "cuda:2"]
    assert placement.trainer == ("cuda:0",) and placement.reference == "cuda:0"
    envs = [server_env({"PATH": "/bin"}, r) for r in placement.replicas]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["1", "2", "1", "2"]
    assert all(r.engine_device == "cuda:0" for r in placement.replicas)  # the child's only GPU
    # the parent's own CUDA_VISIBLE_DEVICES maps this process's indices to the machine's
    assert server_env({"CUDA_VISIBLE_DEVICES": "4,5,6"}, ReplicaPlacement((1, 2)))["CUDA_VISIBLE_DEVICES"] == "5,6"
    assert server_env({}, ReplicaPlacement(()))["CUDA_VISIBLE_DEVICES"] == ""  # a CPU replica sees no GPU


def test_auto_placement_takes_the_gpus_the_trainer_leaves_free():
    assert labels(DeployConfig(num_replicas=3), num_gpus=4) == ["cuda:1", "cuda:2", "cuda:3"]
    two_ranks = plan_placement(DeployConfig(num_replicas=3), num_gpus=4, local_world_size=2)
    assert two_ranks.trainer == ("cuda:0", "cuda:1") and [r.label for r in two_ranks.replicas] == [
        "cuda:2",
        "cuda:3",
        "cuda:2",
    ]
    assert labels(DeployConfig(num_replicas=2), num_gpus=0) == ["cpu", "cpu"]
    assert labels(DeployConfig(), TrainerConfig(device="cpu"), num_gpus=2) == ["cuda:0"]  # trainer on the CPU
    assert labels(DeployConfig(engine_config=EngineConfig(device="cpu")), num_gpus=2) == ["cpu"]
    ref = plan_placement(DeployConfig(), TrainerConfig(reference_device="cuda:1"), num_gpus=3)
    assert ref.reference == "cuda:1" and [r.label for r in ref.replicas] == ["cuda:2"]


# ----------------------------------------------------------------------- refused at start
@pytest.mark.parametrize(
    "cfg, trainer, num_gpus, setting",
    [
        (DeployConfig(), None, 1, "deployment.replica_devices"),  # the only GPU is the trainer's
        (DeployConfig(replica_devices=["cuda:0"]), None, 2, "deployment.replica_devices"),
        (DeployConfig(engine_config=EngineConfig(device="cuda:0")), None, 2, "deployment.engine_config.device"),
        (
            DeployConfig(replica_devices=["cuda:1"]),
            TrainerConfig(reference_device="cuda:1"),
            2,
            "deployment.replica_devices",
        ),
        (DeployConfig(replica_devices=["cuda:3"]), None, 2, "deployment.replica_devices"),  # no such GPU
        (DeployConfig(replica_devices=["cuda:1,2"]), None, 3, "deployment.replica_devices"),  # embedded: one GPU
        (
            DeployConfig(engine="vllm", num_replicas=2, replica_devices=["cuda:1"]),
            None,
            2,
            "deployment.gpu_memory_fraction",
        ),
    ],
)
def test_placements_that_cannot_work_are_refused_naming_the_setting(cfg, trainer, num_gpus, setting):
    with pytest.raises(ValueError, match=f"^{setting}"):
        plan_placement(cfg, trainer, num_gpus=num_gpus)


def test_colocate_and_a_fitting_memory_budget_are_allowed():
    assert labels(DeployConfig(colocate=True), num_gpus=1) == ["cuda:0"]
    shared = DeployConfig(engine="vllm", num_replicas=2, replica_devices=["cuda:1"], gpu_memory_fraction=0.45)
    assert labels(shared, num_gpus=2) == ["cuda:1", "cuda:1"]
    assert labels(DeployConfig(engine="vllm", replica_devices=["cuda:1,2"]), num_gpus=3) == ["cuda:1,2"]
    # two embedded replicas on one GPU: no fixed budget, allowed
    assert labels(DeployConfig(num_replicas=2, replica_devices=["cuda:1"]), num_gpus=2) == ["cuda:1", "cuda:1"]


def test_a_group_refuses_a_gpu_this_machine_lacks_before_starting_anything(tiny_model_path):
    with pytest.raises(ValueError, match="^deployment.replica_devices: replica on cuda:0, but this machine has no GPU"):
        DeploymentGroup(tiny_model_path, DeployConfig(replica_devices=["cuda:0"]))


@pytest.mark.parametrize("bad", [["gpu1"], ["cuda:"], ["cuda:1,1"], "cuda:1"])
def test_bad_replica_devices_are_refused_by_the_config(bad):
    with pytest.raises(ValueError, match="^replica_devices:"):
        DeployConfig(replica_devices=bad)
    with pytest.raises(ValueError, match="^gpu_memory_fraction:"):
        DeployConfig(gpu_memory_fraction=1.5)


# ----------------------------------------------------------------------- the child's environment
def test_server_env_drops_torchrun_variables_and_keeps_the_rest():
    env = server_env({**FAKE_TORCHRUN, "PATH": "/bin", "OMP_NUM_THREADS": "2", "RANKING": "x"}, None)
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2", "RANKING": "x"}  # no CUDA_VISIBLE_DEVICES when unplaced
    assert set(TORCHRUN_VARS) >= {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def test_a_placed_embedded_server_is_launched_on_its_own_gpu(tiny_model_path, tmp_path, monkeypatch):
    for k, v in FAKE_TORCHRUN.items():
        monkeypatch.setenv(k, v)
    dep = EmbeddedDeployment(
        tiny_model_path, DeployConfig(replica_devices=["cuda:1"], engine_env={"X_EXTRA": "1"}), log_file=str(tmp_path)
    )
    env, cmd = dep._env(), dep._command()
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["X_EXTRA"] == "1"
    assert not set(FAKE_TORCHRUN) & set(env)
    assert json.loads(cmd[cmd.index("--engine-config") + 1])["device"] == "cuda:0"


def test_a_real_server_started_under_torchrun_variables_gets_a_clean_env_and_serves(
    tiny_model_path, tmp_path, monkeypatch
):
    """The group's child is started with ``server_env``'s environment (read back from /proc/PID/environ)
    and serves: torchrun's variables in the trainer do not reach it."""
    for k, v in FAKE_TORCHRUN.items():
        monkeypatch.setenv(k, v)
    cfg = DeployConfig(
        engine_config=EngineConfig(max_model_len=64, max_batch_size=2, dtype="float32", decode_kernel="torch"),
        startup_timeout_s=300,
    )
    with DeploymentGroup(tiny_model_path, cfg, log_dir=tmp_path).start() as group:
        assert group.placement.replicas[0].label == "cpu"
        [replica] = group.replicas
        raw = Path(f"/proc/{replica.pid}/environ").read_bytes().split(b"\0")
        child_env = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
        assert not set(FAKE_TORCHRUN) & set(child_env)
        assert child_env["CUDA_VISIBLE_DEVICES"] == ""

        async def sample():
            s = DeploymentSampler(group.base_urls, api_key=group.cfg.api_key)
            try:
                return await s.sample_with_prompt_tokens([5, 17, 42], max_tokens=4, temperature=0.0)
            finally:
                await s.close()

        [c] = asyncio.run(sample())
        assert len(c.full_tokens) - c.prompt_len == 4 and c.weight_version == 0


# ----------------------------------------------------------------------- vLLM and SGLang defaults
def test_vllm_runs_eager_only_on_the_cpu_and_its_interpreter_follows_the_device(tmp_path):
    gpu = VLLMDeployment("/m", DeployConfig(engine="vllm", replica_devices=["cuda:1,2"], gpu_memory_fraction=0.8))
    cmd, env = gpu._command(), gpu._env()
    assert "--enforce-eager" not in cmd and cmd[cmd.index("--tensor-parallel-size") + 1] == "2"
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.8" and cmd[cmd.index("--dtype") + 1] == "auto"
    assert gpu.python == sys.executable and env["CUDA_VISIBLE_DEVICES"] == "1,2"
    assert "VLLM_CPU_KVCACHE_SPACE" not in env
    cpu = VLLMDeployment("/m", DeployConfig(engine="vllm", replica_devices=["cpu"]))
    assert "--enforce-eager" in cpu._command() and cpu._command()[cpu._command().index("--dtype") + 1] == "float32"
    assert cpu.python == (str(VLLM_VENV_PYTHON) if VLLM_VENV_PYTHON.exists() else sys.executable)
    assert VLLMDeployment("/m", DeployConfig(engine="vllm", engine_python="/my/py")).python == "/my/py"


def test_sglang_gets_tensor_parallel_and_memory_flags_on_its_gpus():
    dep = SGLangDeployment("/m", DeployConfig(engine="sglang", replica_devices=["cuda:2,3"], gpu_memory_fraction=0.7))
    cmd = dep._command()
    assert cmd[cmd.index("--tp-size") + 1] == "2" and cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    assert dep._env()["CUDA_VISIBLE_DEVICES"] == "2,3"


SGLANG_HUB_SCRIPT = """
import sys
from pathlib import Path
from training.deployment.backends.sglang import SGLangDeployment
from training.utils.config import DeployConfig
out = Path(sys.argv[1])
SGLangDeployment("org/tiny", DeployConfig(engine="sglang"))._copy_config(out)
print(sorted(p.name for p in out.iterdir()))
"""


def test_sglang_weight_folder_gets_config_json_of_a_hub_id(tmp_path):
    """A hub id's config.json comes from the local hub cache (transformers' ``cached_file``, offline)."""
    snapshot = tmp_path / "hub" / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "qwen3"}')
    (tmp_path / "hub" / "models--org--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny" / "refs" / "main").write_text("abc")
    out = tmp_path / "weights"
    out.mkdir()
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1")
    proc = subprocess.run(
        [sys.executable, "-c", SGLANG_HUB_SCRIPT, str(out)], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (out / "config.json").read_text() == '{"model_type": "qwen3"}'
    assert not (out / "generation_config.json").exists()  # optional, absent from the snapshot


def test_sglang_weight_folder_without_any_config_json_is_refused(tmp_path):
    from training.deployment.weights.files import WeightSyncError

    with pytest.raises(WeightSyncError, match="no config.json"):
        SGLangDeployment(str(tmp_path), DeployConfig(engine="sglang"))._copy_config(tmp_path)


# ----------------------------------------------------------------------- exit barrier, CPU pin
def test_exit_barrier_runs_on_a_gloo_group_when_the_default_group_is_mixed():
    """``cpu:gloo,cuda:nccl`` needs NCCL (absent here): the helper's choice is checked on a real gloo
    group, and the barrier runs on the group it returns."""
    assert not dist.is_initialized()
    store = dist.TCPStore("127.0.0.1", free_port("127.0.0.1"), 1, is_master=True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        assert dist_utils.exit_barrier_group("gloo") is None  # the default group supports it
        group = dist_utils.exit_barrier_group("cpu:gloo,cuda:nccl")
        assert group is not None and dist.get_backend(group) == "gloo"
        dist.monitored_barrier(group=group, timeout=datetime.timedelta(seconds=30))
    finally:
        dist.destroy_process_group()


def test_the_cpu_suite_hides_cuda_unless_only_gpu_tests_run():
    assert selects_only_gpu_tests("gpu") and selects_only_gpu_tests("gpu or slow")
    assert not selects_only_gpu_tests("not gpu") and not selects_only_gpu_tests("")
    assert not selects_only_gpu_tests("not slow and not vllm and not trl and not demo and not gpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and not torch.cuda.is_available()
