"""A group judge served by the embedded engine on the tiny model, over loopback. The model is random, so only the
JSON schema (constrained decoding) makes its answers parse; without it every answer fails and the group is marked."""

import asyncio

import pytest
import requests

from training.deployment.engine.constraints import missing_library
from training.rewards import GroupJudge, JudgeConfig
from training.utils.http import free_port
from training.utils.rl.group_reward import apply_group_reward
from training.utils.rl.groups import run_group
from training.utils.rl.rollout import RolloutSample

needs_library = pytest.mark.skipif(missing_library() is not None, reason="llguidance (training[constrained]) missing")
TEXTS = ["Cats sleep a lot.", "dog", "Cats are small felines that purr.", "meow meow"]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_model_len=1024, max_batch_size=8)


def served_name(server) -> str:
    """The model name the server answers to (a wrong one is a 404 naming it)."""
    return requests.get(server.base_url + "/v1/models", timeout=30).json()["data"][0]["id"]


def judge_on(server, **kw) -> GroupJudge:
    settings = dict(
        model=served_name(server),
        base_url=server.base_url,
        temperature=1.0,
        reason_max_chars=12,
        max_tokens=300,
    )
    settings.update(kw)
    return GroupJudge(JudgeConfig(**settings))


def group_of(texts):
    it = iter(texts)

    async def rollout_fn(row):
        return RolloutSample(
            tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], reward=0.0, text=next(it)
        )

    return asyncio.run(
        run_group(rollout_fn, {"prompt": "One sentence about cats."}, 0, 0, len(texts), 60, asyncio.Semaphore(1))
    )


@needs_library
def test_a_judge_with_a_json_schema_always_returns_parseable_scores(server):
    for seed in range(3):
        judge = judge_on(server, seed=seed, max_retries=0)  # no retry: the first answer must parse
        group = group_of(TEXTS)
        asyncio.run(judge(group))
        rewards = group.rewards
        assert len(rewards) == 4 and all(0.0 <= r <= 1.0 for r in rewards)
        assert (max(rewards), min(rewards)) in {(1.0, 0.0), (0.5, 0.5)}
        first = group.metadata[0]["judge"]
        assert set(first["scores"]) == {"A", "B", "C", "D"} and first["raw"] and first["prompt"]
        assert [group.metadata[k]["judge"]["label"] for k in range(4)] == ["A", "B", "C", "D"]
        assert all(s.reward == group.completion_rewards[k] for s, k in zip(group.samples, group.completion_index))
        m = judge.take_metrics()
        assert m["judge/requests"] == 1 and m["judge/parse_failures"] == 0 and 0 < m["judge/time_share"] <= 1


@needs_library
def test_the_cache_hits_on_repeated_content(server, tmp_path):
    judge = judge_on(server, cache_dir=str(tmp_path))
    first, again = group_of(TEXTS), group_of(TEXTS)
    asyncio.run(judge(first))
    asyncio.run(judge(again))
    assert again.rewards == first.rewards and again.metadata[0]["judge"]["cached"] is True
    m = judge.take_metrics()
    assert m["judge/requests"] == 1 and m["judge/cache_hits"] == 1
    other = judge_on(server, cache_dir=str(tmp_path))  # a new process would read the same files
    asyncio.run(other(group_of(TEXTS)))
    assert other.take_metrics()["judge/requests"] == 0
    asyncio.run(other(group_of(TEXTS[::-1])))  # other content: asked
    assert other.take_metrics()["judge/cache_misses"] == 1


def test_without_the_schema_the_answers_fail_and_mark_the_group(server):
    judge = judge_on(server, structured_output=False, max_retries=1, backoff_s=0.0, max_tokens=40)
    group = group_of(TEXTS)
    asyncio.run(apply_group_reward(judge, group))
    assert group.samples == [] and group.failure_causes == {"judge": 4} and group.errors == 4
    m = judge.take_metrics()
    assert m["judge/parse_failures"] == 2 and m["judge/failed_requests"] == 1


def test_a_dead_endpoint_marks_the_group():
    judge = GroupJudge(JudgeConfig(model="m", base_url=f"http://127.0.0.1:{free_port()}", max_retries=1, backoff_s=0))
    group = group_of(TEXTS[:2])
    asyncio.run(apply_group_reward(judge, group))
    assert group.failure_causes == {"judge": 2} and group.rewards == []
    assert judge.take_metrics()["judge/failed_requests"] == 1


@needs_library
def test_a_judge_without_base_url_launches_its_own_embedded_server(tiny_model_path, tmp_path):
    from training.utils import DeployConfig, EngineConfig

    engine = EngineConfig(max_model_len=1024, max_batch_size=4, device="cpu", dtype="float32")
    deploy = DeployConfig(engine_config=engine, log_file=str(tmp_path / "judge.log"))
    with GroupJudge(JudgeConfig(model=tiny_model_path, deployment=deploy, reason_max_chars=8, max_tokens=200)) as judge:
        assert judge.client.base_url.startswith("http://127.0.0.1:")
        group = group_of(TEXTS[:3])
        asyncio.run(judge(group))
        assert len(group.rewards) == 3 and judge.take_metrics()["judge/requests"] == 1
    assert judge.client.base_url is None  # stopped
