"""A run that is terminated or killed leaves no server process and no /dev/shm weight copy behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from training.deployment.weights.files import SHM_PREFIX, WeightFolder, shm_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "single_turn_token_in"


def _children(pid: int) -> list[int]:
    """Pids whose parent is ``pid`` (from /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _start_run(tmp_path: Path, stderr=subprocess.DEVNULL) -> tuple[subprocess.Popen, list[int]]:
    """A run with shm weight sync; returns once it has pushed weights (trained one step)."""
    log_path = tmp_path / "run"
    args = [
        sys.executable,
        "train.py",
        f"log_path={log_path}",
        "max_steps=200",
        "eval_interval=0",
        "prompt_groups_per_step=2",
        "synchronous_training=true",
        "deployment.weight_sync=shm",
    ]
    proc = subprocess.Popen(args, cwd=EXAMPLE, stdout=subprocess.DEVNULL, stderr=stderr)
    metrics = log_path / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and metrics.read_text().count("\n") >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it could be interrupted"
    servers = _children(proc.pid)
    assert servers, "the run has no server child"
    assert list(shm_dir().glob(f"{SHM_PREFIX}{proc.pid}-*")), "the run wrote no shm weights"
    return proc, servers


def _wait_gone(pids: list[int], timeout_s: float = 30.0) -> list[int]:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


@pytest.mark.usefixtures("tiny_model_path")  # the run's process trains the tiny model
def test_sigterm_unwinds_the_run_stopping_the_server_and_removing_shm_weights(tmp_path):
    proc, servers = _start_run(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert _wait_gone(servers) == []
    assert list(shm_dir().glob(f"{SHM_PREFIX}{proc.pid}-*")) == []


@pytest.mark.usefixtures("tiny_model_path")  # the run's process trains the tiny model
def test_ctrl_c_under_load_stops_at_the_first_press_with_one_line_and_no_traceback(tmp_path):
    burners = [  # the CPU loaded beside the run: a press must not land in code that swallows it
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)
    ]
    try:
        with open(tmp_path / "stderr.txt", "w") as stderr:
            proc, servers = _start_run(tmp_path, stderr=stderr)
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 128 + signal.SIGINT
    finally:
        for burner in burners:
            burner.kill()
    assert _wait_gone(servers) == []
    err = (tmp_path / "stderr.txt").read_text()
    assert "Traceback" not in err
    assert "run stopped;" in err.splitlines()[-1]  # the last line: what a rerun does


@pytest.mark.usefixtures("tiny_model_path")  # the run's process trains the tiny model
def test_sigkill_takes_the_server_down_and_the_next_run_sweeps_the_shm_copy(tmp_path):
    proc, servers = _start_run(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # the trainer only: its server must follow by itself
    proc.wait(timeout=30)
    assert _wait_gone(servers) == []
    folder = WeightFolder("shm")  # the next run on this host sweeps what the killed one left
    try:
        assert list(shm_dir().glob(f"{SHM_PREFIX}{proc.pid}-*")) == []
    finally:
        folder.remove()
    assert not folder.folder.exists()


def test_shm_folder_of_a_dead_process_is_swept_and_a_live_ones_kept():
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = shm_dir() / f"{SHM_PREFIX}{dead.pid}-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"x" * 1024)
    live = WeightFolder("shm")
    try:
        assert not stale.exists()
        other = WeightFolder("shm")  # a second sweep leaves the live owner's folder alone
        other.remove()
        assert live.folder.exists()
    finally:
        live.remove()
