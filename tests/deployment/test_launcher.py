"""EmbeddedDeployment: start, health, restart after kill -9 with the latest weights, clean stop."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from training.deployment.backends.embedded import EmbeddedDeployment
from training.deployment.backends.process import DeploymentStartError
from training.deployment.client import DeploymentSampler
from training.utils.config import DeployConfig, EngineConfig

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def _cfg(tmp_path, **kw) -> DeployConfig:
    base = dict(
        engine_config=EngineConfig(max_model_len=128, max_batch_size=4, device="cpu", dtype="float32"),
        startup_timeout_s=120,
        log_file=str(tmp_path / "server.log"),
    )
    return DeployConfig(**{**base, **kw})


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie still answers kill(0): check its state
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] == "Z"


def _greedy(dep: EmbeddedDeployment) -> tuple[list[int], int]:
    s = DeploymentSampler(dep.base_url, api_key=dep.api_key, max_retries=6, backoff_s=0.5)

    async def go():
        try:
            return await s.sample_with_prompt_tokens(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True)
        finally:
            await s.close()

    [c] = asyncio.run(go())
    return c.output_tokens, c.weight_version


def _perturbed(model_path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(1)
    return {
        k: v + torch.randn(v.shape, generator=g) * (2.0 if "norm" in k else 2.0 * v.float().std())
        for k, v in load_file(f"{model_path}/model.safetensors").items()
    }


def test_killed_server_is_restarted_with_the_latest_weights(tiny_model_path, tmp_path):
    cfg = _cfg(tmp_path, api_key="k", max_restarts=1)
    t0 = time.perf_counter()
    dep = EmbeddedDeployment(tiny_model_path, cfg, watchdog_interval_s=0.2).start()
    print(f"server start to healthy: {time.perf_counter() - t0:.1f} s")
    try:
        assert dep.base_url.startswith("http://127.0.0.1:") and dep.is_alive()
        before, v0 = _greedy(dep)
        timing = asyncio.run(dep.push_weights(_perturbed(tiny_model_path).items(), 3))
        kept = timing["path"]
        assert kept and os.path.exists(kept)  # kept for a restart
        pushed, v3 = _greedy(dep)
        assert v0 == 0 and v3 == 3 and pushed != before

        old_pid = dep.pid
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while not (dep.restart_count == 1 and dep.restarts[0]["ok"]) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert dep.restarts and dep.restarts[0]["ok"], dep.restarts
        assert dep.restarts[0]["exit_code"] == -signal.SIGKILL and dep.pid != old_pid
        after, v_after = _greedy(dep)
        assert v_after == 3 and after == pushed  # came back serving the last pushed weights
        assert dep.ensure_alive() is False  # alive: nothing to do
        os.kill(dep.pid, signal.SIGKILL)  # the restart budget (1) is spent now
        time.sleep(0.6)
        with pytest.raises(DeploymentStartError, match="max_restarts=1"):
            dep.ensure_alive()
        assert dep.restart_count == 1
    finally:
        pid = dep.pid
        dep.stop()
    assert _gone(pid) and not os.path.exists(kept)


def test_ensure_alive_restarts_and_an_exception_in_the_with_block_stops_the_server(tiny_model_path, tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with EmbeddedDeployment(tiny_model_path, _cfg(tmp_path), watchdog_interval_s=3600) as dep:
            os.kill(dep.pid, signal.SIGKILL)
            time.sleep(0.3)
            assert dep.ensure_alive() is True and dep.restart_count == 1
            assert _greedy(dep)[1] == 0
            pid = dep.pid
            raise RuntimeError("boom")
    assert _gone(pid) and not dep.is_alive()
    assert dep.log_path.read_text().rstrip().endswith("deployment server stopped")  # SIGTERM: clean shutdown


def test_startup_failure_and_startup_timeout_report_the_log_tail(tiny_model_path, tmp_path):
    bad = EmbeddedDeployment(tiny_model_path, _cfg(tmp_path), extra_args=["--max-batch-size", "lots"])
    with pytest.raises(DeploymentStartError) as e:
        bad.start()
    assert "exited with code 2" in str(e.value) and "expected an integer, got 'lots'" in str(e.value)
    assert "expected an integer, got 'lots'" in e.value.summary and str(bad.log_path) in e.value.summary
    assert "\n" not in e.value.summary  # what a run that cannot start prints
    slow = EmbeddedDeployment(tiny_model_path, _cfg(tmp_path, startup_timeout_s=0.3))
    with pytest.raises(DeploymentStartError, match="not healthy after 0.3 s"):
        slow.start()
    assert not slow.is_alive()


def test_attached_server_is_checked_loaded_and_never_stopped(tiny_model_path, tmp_path):
    with pytest.raises(DeploymentStartError, match="127.0.0.1:9 is not healthy"):
        EmbeddedDeployment(tiny_model_path, DeployConfig(base_url="http://127.0.0.1:9")).start()
    with EmbeddedDeployment(tiny_model_path, _cfg(tmp_path)) as launched:
        attached = EmbeddedDeployment(tiny_model_path, DeployConfig(base_url=launched.base_url)).start()
        assert attached.pid is None and attached.base_url == launched.base_url
        asyncio.run(attached.push_weights(_perturbed(tiny_model_path).items(), 2))
        attached.stop()  # leaves the server it did not start running
        assert launched.is_alive() and _greedy(launched)[1] == 2


_CHILD_SCRIPT = """
import sys, time
from training.deployment.backends.embedded import EmbeddedDeployment
from training.utils.config import DeployConfig, EngineConfig
dep = EmbeddedDeployment(sys.argv[1], DeployConfig(log_file=sys.argv[3], engine_config=EngineConfig(max_model_len=64, device="cpu", dtype="float32"))).start()
print(dep.pid, flush=True)
if sys.argv[2] == "hang":
    time.sleep(600)
"""


@pytest.mark.parametrize("mode", ["exit", "hang"])
def test_no_orphan_after_interpreter_exit_or_kill9_of_the_trainer(tiny_model_path, tmp_path, mode):
    """'exit': atexit stops the child. 'hang' + kill -9 of the trainer: the child notices and exits."""
    import subprocess
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD_SCRIPT, tiny_model_path, mode, str(tmp_path / "s.log")],
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(proc.stdout.readline())
    if mode == "hang":
        proc.kill()
    proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _gone(child)


def test_push_to_all_replicas_returns_when_every_one_serves_the_new_version(tiny_model_path, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from training.deployment.group import push_weights
    from training.deployment.weights.files import WeightSyncError

    deps = [EmbeddedDeployment(tiny_model_path, _cfg(tmp_path, log_file=str(tmp_path / f"s{i}.log"))) for i in range(2)]
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda d: d.start(), deps))
        new = _perturbed(tiny_model_path)
        out = asyncio.run(push_weights([d.base_url for d in deps], new.items(), 7))
        assert set(out["servers"]) == {d.base_url for d in deps} and not os.path.exists(out["path"])  # shm file removed
        greedy = [_greedy(d) for d in deps]
        assert greedy[0] == greedy[1] and greedy[0][1] == 7
        bad = dict(new)
        bad.pop(next(iter(bad)))  # a missing tensor: refused by both, both keep version 7
        with pytest.raises(WeightSyncError, match="missing"):
            asyncio.run(push_weights([d.base_url for d in deps], bad.items(), 8))
        assert [_greedy(d) for d in deps] == greedy
    finally:
        for d in deps:
            d.stop()


def test_weight_push_right_after_a_server_kill_waits_for_the_restart_and_lands(tiny_model_path, tmp_path):
    from training.deployment.group import DeploymentGroup

    from training.utils.http import control_request

    group = DeploymentGroup(
        tiny_model_path, _cfg(tmp_path, max_restarts=2, weight_sync="shm"), log_dir=tmp_path
    ).start()
    try:
        key = group.cfg.api_key
        assert key  # launched without a key: the group made one, so no other process can drive the server
        assert control_request("POST", group.base_urls[0] + "/pause", {})[0] == 401
        assert control_request("GET", group.base_urls[0] + "/weight_version", api_key=key)[0] == 200
        new = _perturbed(tiny_model_path)
        asyncio.run(group.push(new.items(), 1))
        os.kill(group.replicas[0].pid, signal.SIGKILL)  # dies just before the next push
        out = asyncio.run(group.push(new.items(), 2))
        assert list(out["servers"]) == group.base_urls
        tokens, version = _greedy(group.replicas[0])
        assert version == 2 and group.replicas[0].restart_count == 1
        shm_folder = group._folder.folder
    finally:
        group.stop()
    assert not shm_folder.exists()  # the /dev/shm copy goes with the group
