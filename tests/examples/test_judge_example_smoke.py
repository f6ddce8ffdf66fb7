"""The judge example pair (instructions_judge_smollm2) runs end to end as a user runs it, on the tiny model: its
policy trains on the rewards of a judge launched on a second embedded server, and the eval scores the verifier."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from training.deployment.engine.constraints import missing_library

EXAMPLE = Path(__file__).resolve().parents[2] / "training" / "examples" / "rl" / "instructions_judge_smollm2"


@pytest.mark.skipif(missing_library() is not None, reason="llguidance (training[constrained]) missing")
@pytest.mark.usefixtures("tiny_model_path")  # the example's process trains the tiny model and judges with it
def test_judge_example_trains_only_on_the_judges_rewards(tmp_path):
    run = tmp_path / "run"
    overrides = ["base_model=tiny", "max_steps=2", "eval_interval=2", "prompt_groups_per_step=2"]
    overrides += ["completions_per_prompt=2", "dynamic_filter_fn=null", "eval_rows=" + str(tmp_path / "eval.jsonl")]
    held_out = (EXAMPLE / "eval.jsonl").read_text().splitlines()[:4]
    (tmp_path / "eval.jsonl").write_text("\n".join(held_out) + "\n")
    cmd = [sys.executable, "train.py", f"log_path={run}", *overrides]
    proc = subprocess.run(cmd, cwd=EXAMPLE, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    trained = [m for m in metrics if "train/loss" in m]
    assert [m["step"] for m in trained] == [0, 1]
    assert all(m["judge/groups"] >= 1 and 0 < m["judge/time_share"] <= 1 for m in trained)  # every group judged
    assert sum(m["judge/requests"] for m in trained) >= 2  # a request is counted in the step that sent it
    assert all("rollout/reward/verifier_mean" in m for m in trained)  # the verifier is logged, not trained on
    evals = [m for m in metrics if "eval/pass_rate" in m]  # before step 0, and on the last step's line
    assert [m["step"] for m in evals] == [0, 1] and all(m["eval/failed"] == 0 for m in evals)
    lines = [json.loads(x) for x in (run / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(x["reward"] == x["metadata"]["judge"]["reward"] for x in lines)
    assert all(set(x["reward_components"]) == {"verifier"} for x in lines)
    assert (run / "final" / "config.json").exists()
