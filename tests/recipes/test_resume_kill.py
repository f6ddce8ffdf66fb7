"""A run killed with SIGKILL after a checkpoint resumes at the next step when rerun."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "single_turn_token_in"


@pytest.mark.usefixtures("tiny_model_path")  # the run's process trains the tiny model
def test_killed_run_resumes_after_its_last_checkpoint(tmp_path):
    log_path = tmp_path / "run"
    args = [
        sys.executable,
        "train.py",
        f"log_path={log_path}",
        "max_steps=6",
        "dcp_save_interval=2",
        "eval_interval=0",
        "prompt_groups_per_step=2",
        "synchronous_training=true",
    ]
    proc = subprocess.Popen(
        args, cwd=EXAMPLE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    latest = log_path / "checkpoints" / "latest"
    deadline = time.time() + 300
    while not latest.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert latest.exists(), "no checkpoint was written"
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its server child, mid-run
    proc.wait()
    ckpt = log_path / "checkpoints" / latest.read_text().strip()
    state = json.loads((ckpt / "recipe_state.json").read_text())
    assert state["step"] in (2, 4)

    done = subprocess.run(args, cwd=EXAMPLE, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "train/loss" in r]
    resumed = steps[len(steps) - (6 - state["step"]) :]
    assert resumed == list(range(state["step"], 6))  # the rerun starts right after the checkpoint
    assert len(steps) == len(set(steps))  # rows the killed run wrote for redone steps were set aside
    replaced = log_path / "metrics.replaced.jsonl"
    if replaced.exists():
        assert all(json.loads(line)["step"] >= state["step"] for line in replaced.read_text().splitlines())
    assert "resumed from" in done.stderr
    final_state = json.loads((log_path / "checkpoints" / "step_000006" / "recipe_state.json").read_text())
    assert final_state["cursor"]["done_floor"] == 12  # 6 steps x 2 rows: each row trained once
