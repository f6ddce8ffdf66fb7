"""The recipe awaits Config.group_reward_fn on each training group: a judge on the embedded tiny-model server sets
the rewards, its records reach rollouts.jsonl and its judge/* metrics (time share included) reach metrics.jsonl."""

import json

import pytest
import requests

from training.deployment.engine.constraints import missing_library
from training.recipes import rl_loop
from training.rewards import GroupJudge, JudgeConfig
from training.utils import DeployConfig
from training.utils.metrics import read_metrics
from tests.recipes.test_recipes import config as recipes_config
from training.utils.rl.rollout import RolloutSample

ROWS = [{"prompt": f"say {i}", "prompt_ids": [1, 10 + i, 201]} for i in range(8)]


@pytest.fixture(scope="module")
def policy(embedded_server):
    return embedded_server(fresh=True, max_batch_size=8)  # the run pushes its weights to it


@pytest.fixture(scope="module")
def judge_server(embedded_server):
    return embedded_server(max_model_len=1024, max_batch_size=8)


def make_rollout_fn(setup):
    sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

    async def rollout_fn(row):
        (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
        n = len(c.full_tokens) - c.prompt_len
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * n,
            reward=0.0,
            text=c.text,
        )

    return rollout_fn


@pytest.mark.skipif(missing_library() is not None, reason="llguidance (training[constrained]) missing")
def test_rl_loop_trains_on_judge_rewards_and_logs_the_judgements(tiny_model_path, policy, judge_server, tmp_path):
    name = requests.get(judge_server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    judge = GroupJudge(JudgeConfig(model=name, base_url=judge_server.base_url, reason_max_chars=8, max_tokens=200))
    cfg = recipes_config(
        tiny_model_path,
        None,
        tmp_path,
        completions_per_prompt=3,
        deployment=DeployConfig(base_url=policy.base_url),
        group_reward_fn=judge,
    )
    out = rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
    assert out["steps"] == 2
    metrics = read_metrics(out["log_path"])
    steps = [m for m in metrics if "judge/requests" in m]
    assert len(steps) == 2 and all(m["judge/groups"] >= 2 and 0 < m["judge/time_share"] <= 1 for m in steps)
    assert all("reward/judge_score" in m for m in steps)
    lines = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert lines and all(x["metadata"]["judge"]["reward"] == x["reward"] for x in lines)
    assert any("raw" in x["metadata"]["judge"] and "prompt" in x["metadata"]["judge"] for x in lines)
