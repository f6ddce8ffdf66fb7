"""DeploymentSampler against a real server (token contract) and a scripted fake (retry policy)."""

from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web

from training.deployment.backends.embedded import EmbeddedDeployment
from training.utils.http import free_port
from training.deployment.client import Completion, DeploymentRequestError, DeploymentSampler
from training.utils.config import DeployConfig, EngineConfig
from training.utils.rl.rollout import RolloutSetup

API_KEY = "sampler-key"
PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def deployment(embedded_server):
    return embedded_server(api_key=API_KEY, max_model_len=256, max_batch_size=8)


@pytest.fixture
def sampler(deployment):
    return DeploymentSampler(deployment.base_url, api_key=API_KEY, max_retries=1, backoff_s=0.05)


def test_completions_carry_exact_tokens_and_one_logprob_per_output_token(sampler):
    async def go():
        out = await sampler.sample_with_prompt_tokens(PROMPT, n=3, max_tokens=7, temperature=1.0, seed=1)
        await sampler.close()
        return out

    comps = asyncio.run(go())
    assert len(comps) == 3
    for c in comps:
        assert isinstance(c, Completion)
        assert c.prompt_tokens == PROMPT and c.prompt_len == len(PROMPT)
        assert 1 <= len(c.output_tokens) <= 7 and len(c.inference_logprobs) == len(c.output_tokens)
        assert all(lp <= 0 for lp in c.inference_logprobs) and c.weight_version == 0
        assert c.token_weight_versions == [0] * len(c.output_tokens)
        assert c.finish_reason in ("stop", "length") and c.tool_calls == [] and c.message is None


def test_with_defaults_layers_sampling_and_shares_the_connection(sampler):
    s2 = sampler.with_defaults(max_tokens=5, ignore_eos=True, temperature=0.0)
    s3 = s2.with_defaults(max_tokens=2)
    assert s2._client is sampler._client is s3._client

    async def go():
        a = await s2.sample_with_prompt_tokens(PROMPT)
        b = await s3.sample_with_prompt_tokens(PROMPT)
        c = await s3.sample_with_prompt_tokens(PROMPT, max_tokens=4)  # a call's own kwargs win
        await sampler.close()
        return a, b, c

    a, b, c = asyncio.run(go())
    assert len(a[0].output_tokens) == 5 and len(b[0].output_tokens) == 2 and len(c[0].output_tokens) == 4
    assert c[0].output_tokens == a[0].output_tokens[:4]  # greedy: same prefix


def test_build_deployment_sampler_uses_setup_defaults_and_example_import_path(sampler):
    from training.examples.rl.vanilla_sampler import build_deployment_sampler as from_example

    setup = RolloutSetup(sampler=sampler, tokenizer=None, sampling_kwargs={"max_tokens": 3, "ignore_eos": True})
    s = from_example(setup)
    assert s.sampling_defaults == {"max_tokens": 3, "ignore_eos": True}
    comps = asyncio.run(s.sample_with_prompt_tokens(PROMPT))
    assert len(comps[0].output_tokens) == 3


def test_chat_returns_message_and_token_detail(sampler):
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    comps = asyncio.run(
        sampler.chat(
            [{"role": "user", "content": "what is 2 + 2"}], n=2, tools=tools, max_tokens=6, temperature=1.0, seed=0
        )
    )
    for c in comps:
        assert c.message["role"] == "assistant" and isinstance(c.tool_calls, list)
        assert len(c.inference_logprobs) == len(c.output_tokens) >= 1
        assert c.prompt_len > 10 and c.full_tokens[: c.prompt_len] == comps[0].prompt_tokens


def test_session_header_reuses_kv(sampler):
    async def go():
        fresh = [77, 78, 79, 80, 81, 82]  # no other test sent it: nothing of it is cached yet
        [a] = await sampler.sample_with_prompt_tokens(fresh, session_id="s1", max_tokens=4, ignore_eos=True)
        [b] = await sampler.sample_with_prompt_tokens(a.full_tokens + [40, 41], session_id="s1", max_tokens=2)
        return a, b

    a, b = asyncio.run(go())
    assert a.cached_tokens == 0 and b.cached_tokens > 0


def test_client_error_is_raised_at_once_with_server_message(sampler):
    with pytest.raises(DeploymentRequestError) as e:
        asyncio.run(sampler.sample_with_prompt_tokens(PROMPT, temperature=-1.0))
    assert e.value.status == 400 and e.value.param == "temperature" and "temperature" in str(e.value)
    with pytest.raises(DeploymentRequestError) as e:
        asyncio.run(DeploymentSampler(sampler.base_url, api_key="wrong").sample_with_prompt_tokens(PROMPT))
    assert e.value.status == 401


def test_one_sampler_survives_several_event_loops(sampler):
    for _ in range(3):  # each asyncio.run is a new loop; the old loop's session must not be reused
        comps = asyncio.run(sampler.sample_with_prompt_tokens(PROMPT, max_tokens=2))
        assert comps[0].output_tokens
    assert len(sampler._client._sessions) <= 1


# ---- retry policy against a scripted fake server ----


def _fake_completion(n_tokens: int = 2) -> dict:
    return {
        "choices": [
            {
                "index": 0,
                "text": "",
                "finish_reason": "length",
                "weight_version": 5,
                "token_ids": list(range(n_tokens)),
                "prompt_token_ids": PROMPT,
                "logprobs": {"token_logprobs": [-0.5] * n_tokens},
            }
        ],
        "usage": {"prompt_tokens_details": {"cached_tokens": 0}},
        "weight_version": 5,
    }


async def _with_fake(script, fn):
    """Serve /v1/completions from ``script`` (a list of (status, body, delay_s)), run ``fn(url)``."""
    hits = []

    async def handler(request):
        status, body, delay = script[min(len(hits), len(script) - 1)]
        hits.append(request.headers.get("x-multi-turn-session-id"))
        await asyncio.sleep(delay)
        return web.json_response(body, status=status)

    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await fn(f"http://127.0.0.1:{port}"), hits
    finally:
        await runner.cleanup()


def test_5xx_is_retried_with_backoff_then_succeeds():
    err = {"error": {"message": "overloaded"}}
    script = [(503, err, 0), (500, err, 0), (200, _fake_completion(), 0)]

    async def fn(url):
        s = DeploymentSampler(url, max_retries=3, backoff_s=0.05)
        t0 = time.perf_counter()
        out = await s.sample_with_prompt_tokens(PROMPT, session_id="abc")
        await s.close()
        return out, time.perf_counter() - t0

    (out, elapsed), hits = asyncio.run(_with_fake(script, fn))
    assert len(hits) == 3 and hits == ["abc"] * 3  # the session header is sent on every attempt
    assert elapsed >= 0.05 + 0.1 - 0.01  # backoff 0.05 then 0.1
    assert out[0].weight_version == 5 and out[0].full_tokens == PROMPT + [0, 1]


def test_token_weight_versions_from_the_server_else_the_version_sent_under():
    """Per-token versions as reported; a server without versions (vLLM) gets the one noted at send time."""
    per_token = _fake_completion(3)
    per_token["choices"][0]["token_weight_versions"] = [4, 4, 5]
    no_version = _fake_completion(3)
    del no_version["choices"][0]["weight_version"], no_version["weight_version"]
    only_choice_version = _fake_completion(3)

    async def go(url):
        s = DeploymentSampler(url, max_retries=0)
        s.note_weight_version(2)
        try:
            return [(await s.sample_with_prompt_tokens(PROMPT, max_tokens=3))[0] for _ in range(3)]
        finally:
            await s.close()

    script = [(200, per_token, 0)]
    (reported, *_), _ = asyncio.run(_with_fake(script, go))
    assert reported.token_weight_versions == [4, 4, 5] and reported.weight_version == 5
    (unversioned, *_), _ = asyncio.run(_with_fake([(200, no_version, 0)], go))
    assert unversioned.token_weight_versions == [2, 2, 2] and unversioned.weight_version == 2
    (partial, *_), _ = asyncio.run(_with_fake([(200, only_choice_version, 0)], go))
    assert partial.token_weight_versions is None and partial.weight_version == 5


def test_4xx_is_not_retried_and_retries_are_bounded():
    async def bad(url):
        s = DeploymentSampler(url, max_retries=3, backoff_s=0.01)
        try:
            with pytest.raises(DeploymentRequestError) as e:
                await s.sample_with_prompt_tokens(PROMPT)
            return e.value
        finally:
            await s.close()

    err, hits = asyncio.run(_with_fake([(400, {"error": {"message": "no", "param": "prompt"}}, 0)], bad))
    assert len(hits) == 1 and err.status == 400 and err.param == "prompt"
    err, hits = asyncio.run(_with_fake([(502, {"error": {"message": "down"}}, 0)], bad))
    assert len(hits) == 4 and err.status == 502 and "gave up after 4 attempts" in str(err)


def test_connection_refused_gives_up_and_timeout_raises():
    s = DeploymentSampler(f"http://127.0.0.1:{free_port()}", max_retries=2, backoff_s=0.01)
    with pytest.raises(DeploymentRequestError, match="gave up after 3 attempts"):
        asyncio.run(s.sample_with_prompt_tokens(PROMPT))

    async def slow(url):
        s = DeploymentSampler(url, timeout_s=0.3, max_retries=2)
        try:
            with pytest.raises(DeploymentRequestError, match="no answer within"):
                await s.sample_with_prompt_tokens(PROMPT)
        finally:
            await s.close()

    _, hits = asyncio.run(_with_fake([(200, _fake_completion(), 2.0)], slow))
    assert len(hits) == 1


def test_malformed_server_answer_is_an_error():
    bad = _fake_completion(3)
    bad["choices"][0]["logprobs"]["token_logprobs"] = [-1.0]  # 1 logprob for 3 tokens

    async def fn(url):
        s = DeploymentSampler(url)
        try:
            with pytest.raises(DeploymentRequestError, match="1 logprobs for 3 tokens"):
                await s.sample_with_prompt_tokens(PROMPT)
        finally:
            await s.close()

    asyncio.run(_with_fake([(200, bad, 0)], fn))


def test_constructor_validates_arguments():
    with pytest.raises(ValueError, match="base_url"):
        DeploymentSampler("localhost:8000")
    with pytest.raises(ValueError, match="max_retries"):
        DeploymentSampler("http://x", max_retries=-1)
    assert DeploymentSampler("http://h:1/v1/").base_url == "http://h:1"


def test_replica_choice_is_sticky_per_session_and_least_loaded_otherwise():
    from training.deployment.client import DeploymentSampler

    s = DeploymentSampler(["http://127.0.0.1:1/v1", "http://127.0.0.1:2"])
    assert s.base_urls == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    picks = {sid: s.pick_replica(sid) for sid in (f"session-{i}" for i in range(40))}
    assert all(s.pick_replica(sid) == url for sid, url in picks.items())
    assert set(picks.values()) == set(s.base_urls)
    s._client.in_flight.update({"http://127.0.0.1:1": 3, "http://127.0.0.1:2": 1})
    assert s.pick_replica(None) == "http://127.0.0.1:2"
    assert s.with_defaults(max_tokens=2).base_urls == s.base_urls
    with pytest.raises(ValueError, match="base_url"):
        DeploymentSampler(["http://ok:1", "ftp://bad"])


def test_dead_replica_is_skipped_its_sessions_remapped_and_it_comes_back(deployment, tiny_model_path, tmp_path):
    """Replica failover: one live server and one port nobody listens on (a real refused connection)."""
    dead_port = free_port()
    dead = f"http://127.0.0.1:{dead_port}"
    live = deployment.base_url
    s = DeploymentSampler([dead, live], api_key=API_KEY, max_retries=2, backoff_s=0.05, down_s=1.0)
    pinned_to_dead = next(
        sid for sid in (f"s{i}" for i in range(100)) if DeploymentSampler([dead, live]).pick_replica(sid) == dead
    )

    async def burst():
        return await asyncio.gather(
            *(s.sample_with_prompt_tokens(PROMPT, max_tokens=2) for _ in range(8)),
            s.sample_with_prompt_tokens(PROMPT, max_tokens=2, session_id=pinned_to_dead),
        )

    t0 = time.perf_counter()
    results = asyncio.run(burst())
    assert all(len(r) == 1 and len(r[0].output_tokens) == 2 for r in results)
    assert time.perf_counter() - t0 < 5  # failed over at once, not after the backoff schedule
    assert s.live_replicas() == [live] and s.pick_replica(pinned_to_dead) == live  # marked down, session re-mapped

    cfg = DeployConfig(
        api_key=API_KEY,
        port=dead_port,
        startup_timeout_s=120,
        log_file=str(tmp_path / "b.log"),
        engine_config=EngineConfig(max_model_len=256, max_batch_size=8, device="cpu", dtype="float32"),
    )
    with EmbeddedDeployment(tiny_model_path, cfg):
        time.sleep(1.1)  # the down mark expires
        assert s.pick_replica(pinned_to_dead) == dead
        (c,) = asyncio.run(s.sample_with_prompt_tokens(PROMPT, max_tokens=2, session_id=pinned_to_dead))
        assert len(c.output_tokens) == 2 and s.live_replicas() == [dead, live]
        asyncio.run(s.close())
