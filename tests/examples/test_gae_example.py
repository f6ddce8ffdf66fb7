"""PPO with a critic through a whole run: the single-turn example with ``advantage=gae`` on the tiny model trains
its value head (logged every step); with checkpoints a rerun resumes the head too (slow: two runs)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.examples.test_examples import EXAMPLES, run_example

GAE = ("eval_interval=0", "prompt_groups_per_step=2", "advantage=gae", "critic.lam=0.95")


def _check_critic_metrics(trained: list[dict]) -> None:
    for m in trained:
        for key in ("train/value_loss", "train/value_grad_norm", "train/value_explained_variance"):
            assert math.isfinite(m[key]), key
        assert m["train/advantage_mean"] == pytest.approx(0.0, abs=1e-5)  # whitened over the step
    assert trained[0]["train/value_mean"] == 0.0  # the zero-initialised head
    assert trained[1]["train/value_mean"] != 0.0  # it trained at step 0


@pytest.mark.usefixtures("tiny_model_path")  # the example's process trains the tiny model
def test_the_single_turn_example_trains_a_critic(tmp_path):
    metrics = run_example("single_turn_token_in", tmp_path / "run", "max_steps=2", *GAE)
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    _check_critic_metrics(trained)


@pytest.mark.slow
@pytest.mark.usefixtures("tiny_model_path")
def test_a_rerun_of_a_gae_run_resumes_its_critic(tmp_path):
    log_path = tmp_path / "run"
    run_example("single_turn_token_in", log_path, "max_steps=2", "dcp_save_interval=1", *GAE)
    proc = subprocess.run(
        [sys.executable, "train.py", f"log_path={log_path}", "max_steps=3", "dcp_save_interval=1", *GAE],
        cwd=EXAMPLES / "single_turn_token_in",
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "resumed from" in proc.stderr
    metrics = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1, 2]
    assert trained[2]["train/value_mean"] != 0.0  # the head came back trained, not zero-initialised
