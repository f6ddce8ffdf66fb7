"""A run killed while its trainer waits for a straggler (stale_policy="wait") loses no row on resume."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

SCRIPT = """
import asyncio, os, random, sys
from training.recipes import async_rl_loop
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.rl.rollout import RolloutSample

STRAGGLER = int(os.environ.get("STRAGGLER", "-1"))

def factory(setup):
    sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

    async def rollout_fn(row):
        if row["id"] == STRAGGLER:
            await asyncio.sleep(3600)  # never finishes: the trainer reaches its deadline and waits
        (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
        n = len(c.full_tokens) - c.prompt_len
        return RolloutSample(tokens=c.full_tokens, logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                             loss_mask=[0] * c.prompt_len + [1] * n, reward=random.random())
    return rollout_fn

rows = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(8)]
cfg = async_rl_loop.Config(
    base_model=sys.argv[1], log_path=sys.argv[2], completions_per_prompt=2, prompt_groups_per_step=1,
    max_head_offpolicy_versions=1, max_tokens=4, dcp_save_interval=1, shuffle_rows=False,
    export_final_model=False, trainer=TrainerConfig(learning_rate=1e-3), loss=LossConfig(kl_beta=0.0),
    deployment=DeployConfig(engine_config=EngineConfig(max_batch_size=8, max_model_len=256)))
async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=rows)
"""


def test_kill_while_the_trainer_waits_for_a_straggler_loses_no_row(tiny_model_path, tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT)
    log_path, stderr = tmp_path / "run", tmp_path / "first.log"
    env = {**os.environ, "STRAGGLER": "3", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    with stderr.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, str(script), tiny_model_path, str(log_path)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    deadline = time.time() + 300
    while "waits for" not in stderr.read_text() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert "waits for" in stderr.read_text(), stderr.read_text()[-3000:]
    time.sleep(1.0)  # the waiting step stays blocked: nothing to train until row 3 finishes
    os.killpg(proc.pid, signal.SIGKILL)  # the trainer and its server child, mid-wait
    proc.wait()
    state = json.loads(
        (
            log_path / "checkpoints" / (log_path / "checkpoints" / "latest").read_text().strip() / "recipe_state.json"
        ).read_text()
    )
    assert 3 not in range(state["cursor"]["done_floor"]), "row 3 never finished, so it cannot be done"

    env["STRAGGLER"] = "-1"
    done = subprocess.run(
        [sys.executable, str(script), tiny_model_path, str(log_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    steps_of: dict[int, set] = {}
    for line in (log_path / "rollouts.jsonl").read_text().splitlines():
        r = json.loads(line)
        steps_of.setdefault(r["row_position"], set()).add(r["step"])
    assert sorted(steps_of) == list(range(8))  # every row trained, the straggler included
    assert all(len(s) == 1 for s in steps_of.values())  # and none twice
    final = json.loads((log_path / "checkpoints" / "step_000008" / "recipe_state.json").read_text())
    assert final["cursor"]["done_floor"] == 8
