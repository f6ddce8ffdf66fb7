"""Faults a run must survive (issue #18's matrix), each on the tiny model against the real server.

Rows covered elsewhere: a killed and resumed trainer (test_resume_kill.py), SIGTERM / SIGKILL
leaving no server or /dev/shm copy (test_exit_cleanup.py), a server killed before a weight push
(test_launcher.py), failing and hanging rollouts (test_recipes.py).
"""

import json
import time

import pytest

from tests.test_recipes import ROWS
from tests.test_recipes import config as recipes_config
from training.deployment.embedded import EmbeddedDeployment
from training.recipes import async_rl_loop
from training.utils import DeployConfig, EngineConfig
from training.utils.metrics import read_metrics
from training.utils.rl.rollout import RolloutSample


@pytest.fixture(scope="module")
def server(tiny_model_path, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with EmbeddedDeployment(
        tiny_model_path, DeployConfig(engine_config=EngineConfig(max_batch_size=16)), log_file=str(log)
    ) as dep:
        yield dep


def config(tiny_model_path, server, tmp_path, **kw):
    """``test_recipes.config`` with rows in order (these tests name rows by position)."""
    return recipes_config(tiny_model_path, server, tmp_path, **{"shuffle_rows": False, **kw})


def sampling_rollout(setup, before=None):
    sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

    async def rollout_fn(row):
        if before is not None:
            await before(row)
        (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
        out = c.output_tokens
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * len(out),
            reward=sum(t % 2 == 0 for t in out) / len(out) + row["id"] * 1e-3 + time.time() % 1e-4,
        )

    return rollout_fn


def test_a_rollout_blocking_the_event_loop_times_out_nothing(tiny_model_path, server, tmp_path, caplog):
    """One rollout calls time.sleep(4) on the loop; the deadline is 2 s. Before the watchdog, every
    rollout in flight counted as timed out and the run stopped; now the stall is reported with its
    stack and the run trains on."""
    blocked = []

    def factory(setup):
        async def before(row):
            if row["id"] == 1 and not blocked:
                blocked.append(True)
                time.sleep(4.0)  # noqa: ASYNC251 - the fault under test

        return sampling_rollout(setup, before)

    cfg = config(
        tiny_model_path, server, tmp_path, rollout_timeout_s=2.0, max_concurrency=8, max_rollout_error_fraction=0.3
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert out["steps"] == 2 and blocked
    m = read_metrics(cfg.log_path)
    assert sum(r.get("rollout/timeouts", 0) for r in m) == 0
    assert any("event loop has been blocked" in r.getMessage() and "before" in r.getMessage() for r in caplog.records)


def test_a_malformed_sample_costs_one_completion_and_its_row_is_still_trained(tiny_model_path, server, tmp_path):
    """Row 2's first rollout returns 3 logprobs for 4 tokens: counted invalid, never trained, the run goes on."""
    broken = []

    def factory(setup):
        good = sampling_rollout(setup)

        async def rollout_fn(row):
            sample = await good(row)
            if row["id"] == 2 and not broken:
                broken.append(True)
                sample.logprobs = sample.logprobs[:-1]
            return sample

        return rollout_fn

    cfg = config(
        tiny_model_path, server, tmp_path, completions_per_prompt=3, max_steps=3, max_rollout_error_fraction=0.5
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=factory, rows=ROWS)
    assert out["steps"] == 3 and broken
    m = read_metrics(cfg.log_path)
    assert sum(r.get("rollout/invalid", 0) for r in m) == 1
    trained_rows = [
        json.loads(line)["row_position"] for line in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert trained_rows.count(2) == 2  # its two valid completions
    assert set(trained_rows) == set(range(6))  # 3 steps x 2 rows, none lost


def test_a_checkpoint_write_cut_short_resumes_from_the_previous_one(tiny_model_path, server, tmp_path):
    """Simulated state of a kill in the middle of writing checkpoint 2 (a partial ``step_000002.tmp`` next to
    ``latest`` -> step 1): the rerun resumes at step 1 and writes step 2 over the debris."""
    cfg = config(tiny_model_path, server, tmp_path, max_steps=1, dcp_save_interval=1, synchronous_training=True)
    async_rl_loop.main(cfg, rollout_fn_factory=sampling_rollout, rows=ROWS)
    ckpts = tmp_path / "run" / "checkpoints"
    debris = ckpts / "step_000002.tmp"
    debris.mkdir()
    (debris / "__0_0.distcp").write_bytes(b"half a tensor")
    assert (ckpts / "latest").read_text().strip() == "step_000001"
    longer = config(tiny_model_path, server, tmp_path, max_steps=2, dcp_save_interval=1, synchronous_training=True)
    out = async_rl_loop.main(longer, rollout_fn_factory=sampling_rollout, rows=ROWS)
    assert out["steps"] == 2
    assert (ckpts / "latest").read_text().strip() == "step_000002" and not debris.exists()
    state = json.loads((ckpts / "step_000002" / "recipe_state.json").read_text())
    assert state["step"] == 2 and state["cursor"]["done_floor"] == 4  # rows 0-3, each trained once
