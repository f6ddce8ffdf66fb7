"""A new user's first hour: run an example, run it again, kill it, rerun; see where everything went.

- the filter the docs recommend keeps a group whose calls earned different rewards (per-call credit);
- a run killed between a step's log and its checkpoint keeps that step's records (the step is
  logged first, then checkpointed; the rerun trains it again and sets the first rows aside);
- the default example, then the README's override example, then the default example again each
  run to their summary without a traceback (the second default run resumes its folder, the
  override run takes a numbered folder).
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from training.utils.rl.filters import has_learning_signal
from training.utils.rl.groups import PromptGroup
from training.utils.rl.rollout import RolloutSample

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "training" / "examples" / "rl" / "single_turn_token_in"


def _group(returns: list[float], call_rewards: list[list[float]]) -> PromptGroup:
    """A group as ``run_group`` builds it from ``RolloutRun``s with ``segment_rewards`` and g = 1."""
    g = PromptGroup(position=0, row={}, submit_version=0)
    for k, (ret, calls) in enumerate(zip(returns, call_rewards)):
        g.completion_rewards[k] = ret
        for r in calls:
            g.samples.append(RolloutSample(tokens=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1], reward=r))
            g.completion_index.append(k)
            g.return_weights.append(1.0)
    return g


def test_has_learning_signal_keeps_equal_returns_with_different_call_credit():
    # both episodes fail (return 0), but one call of the first was penalised for a tool error (AIR)
    pg = _group([0.0, 0.0], [[-0.2, 0.0], [0.0, 0.0]])
    assert not (len(set(pg.rewards)) > 1)  # the returns-only filter drops it ...
    assert has_learning_signal(pg)  # ... though its advantages differ
    pg.compute_advantages()
    assert len(set(pg.advantages)) > 1
    assert not has_learning_signal(_group([1.0, 1.0, 1.0], [[1.0], [1.0], [1.0]]))  # nothing to learn
    assert has_learning_signal(_group([1.0, 0.0], [[1.0], [0.0]]))
    assert not has_learning_signal(_group([1.0], [[1.0]]))  # one completion: no group to compare


def test_summary_names_what_was_trained_and_where_everything_is(tmp_path, monkeypatch):
    from training.utils.run_summary import log_summary, run_summary

    run = tmp_path / "runs" / "r"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "checkpoints" / "step_000003" / "recipe_state.json").write_text("{}")
    (run / "checkpoints" / "step_000003" / ".metadata").write_bytes(b"dcp")  # a checkpoint from before manifests
    (run / "checkpoints" / "latest").write_text("step_000003")
    rows = [{"step": 0, "eval/reward_mean": 0.25}] + [{"step": k, "rollout/reward_mean": 0.1 * k} for k in range(3)]
    rows.append({"step": 3, "eval/reward_mean": 0.5})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(sys, "argv", ["train.py", "max_steps=3", "seed=1"])
    text = run_summary(run, {"steps": 3, "final_model": str(run / "final")}, start_step=1, wall_s=75.0)
    assert text.splitlines()[0] == (
        "run finished: 2 step(s) trained this time (resumed at step 1, now at step 3), in 1 min 15 s"
    )
    assert "reward (rollouts): 0.000 -> 0.200 (first -> last)" in text
    assert "eval reward: 0.250 -> 0.500 (first -> last)" in text
    assert f"final model:  {run / 'final'}" in text and f"metrics:      {run / 'metrics.jsonl'}" in text
    assert f"python -m training.plot {run}" in text
    assert f"train longer: python train.py seed=1 log_path={run} max_steps=<more>" in text
    log_summary(run, text)
    assert (run / "summary.txt").read_text() == text + "\n"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


KILL_AFTER_CHECKPOINT = """
import os, runpy, signal, sys
from training.recipes import context

write = context.RunContext.write_checkpoint  # every checkpoint's DCP write, whoever calls it

def write_then_die(self, step_done, state):
    write(self, step_done, state)
    if step_done == 1:  # right after step 0's checkpoint: nothing that comes later in the step runs
        os.killpg(0, signal.SIGKILL)

context.RunContext.write_checkpoint = write_then_die
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.usefixtures("tiny_model_path")  # the run's process trains the tiny model
def test_a_kill_right_after_a_checkpoint_keeps_that_steps_records(tmp_path):
    """SIGKILL the real recipe (trainer and server) at the moment step 0's checkpoint is written."""
    log_path = tmp_path / "run"
    args = [
        f"log_path={log_path}",
        "max_steps=2",
        "dcp_save_interval=1",
        "eval_interval=0",
        "prompt_groups_per_step=2",
        "synchronous_training=true",
        "export_final_model=false",
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    killed = subprocess.run(
        [sys.executable, "-c", KILL_AFTER_CHECKPOINT, *args],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        start_new_session=True,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert (log_path / "checkpoints" / "latest").read_text().strip() == "step_000001"
    assert [r["step"] for r in _rows(log_path / "metrics.jsonl") if "train/loss" in r] == [0]
    assert {r["step"] for r in _rows(log_path / "rollouts.jsonl")} == {0}

    done = subprocess.run(
        [sys.executable, "train.py", *args], cwd=EXAMPLE, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    steps = [r["step"] for r in _rows(log_path / "metrics.jsonl") if "train/loss" in r]
    assert steps == [0, 1]  # step 0 from the killed run, step 1 from the rerun: nothing lost, nothing twice
    assert {r["step"] for r in _rows(log_path / "rollouts.jsonl")} == {0, 1}


def _run(folder: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "train.py", *overrides], cwd=folder, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "run finished:" in proc.stderr, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_default_then_override_then_default_again_each_end_with_a_summary(tmp_path):
    """As the README has a user do it, in a fresh copy of the example (small: 2 steps, no eval)."""
    folder = tmp_path / "single_turn_token_in"
    shutil.copytree(EXAMPLE, folder)
    small = ("max_steps=2", "eval_interval=0", "prompt_groups_per_step=2", "dcp_save_interval=1")
    first = _run(folder, *small)
    run = folder / "runs" / "single_turn_token_in"
    assert "final model:  runs/single_turn_token_in/final" in first.stderr  # as given: relative to the folder
    assert "python -m training.plot runs/single_turn_token_in " in first.stderr
    assert "train longer: python train.py eval_interval=0 prompt_groups_per_step=2 dcp_save_interval=1 " in first.stderr
    assert (run / "summary.txt").read_text().startswith("run finished: 2 step(s)")

    # the README's override example, shortened: other training settings, so a new numbered folder
    override = _run(folder, *small, "loss.policy_loss=gspo", "trainer.learning_rate=1e-4")
    second = folder / "runs" / "single_turn_token_in-2"
    assert "this run writes to runs/single_turn_token_in-2" in override.stderr
    assert len(_rows(second / "metrics.jsonl")) == 2

    again = _run(folder, *small)  # the default again: resumes the first run, which is complete
    assert "resumed from" in again.stderr and "0 step(s) trained this time (resumed at step 2" in again.stderr
    assert [r["step"] for r in _rows(run / "metrics.jsonl") if "train/loss" in r] == [0, 1]
    longer = _run(folder, "max_steps=3", *small[1:])  # what the summary says to do to train longer
    assert "1 step(s) trained this time (resumed at step 2, now at step 3)" in longer.stderr
    assert [r["step"] for r in _rows(run / "metrics.jsonl") if "train/loss" in r] == [0, 1, 2]
