"""Colocation on one device (the sleep / wake lifecycle): the server's ``/sleep``, ``/wake_up``, ``/is_sleeping`` over
real HTTP, the memory they give back (the server process's VmRSS), and a colocated recipe run.

SmolLM2 (135M parameters, fp32) makes the freed bytes measurable against the process's RSS; the
behavioural tests and the recipe run use the tiny model.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from training.models import smollm2
from training.models.smollm2 import is_converted
from training.recipes import async_rl_loop
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.metrics import read_metrics

API_KEY = "colocate-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = [1, 10, 20, 201, 33, 7]


def call(dep, method, path, body=None, headers=AUTH):
    async def go():
        async with aiohttp.ClientSession() as s:
            data = json.dumps(body) if body is not None else None
            async with s.request(method, dep.base_url + path, data=data, headers=headers) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def greedy(dep, n_tokens=10):
    """(token ids, logprobs, weight_version) of a greedy completion of PROMPT."""
    status, out = call(
        dep,
        "POST",
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": n_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_token_ids": True,
            "logprobs": 0,
        },
    )
    assert status == 200, out
    c = out["choices"][0]
    return c["token_ids"], c["logprobs"]["token_logprobs"], c["weight_version"]


def server_rss_bytes(dep) -> int:
    """VmRSS of the server process (the orphan guard's child when the server runs under one)."""
    pid = dep.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    pid = int(children[0]) if children else pid
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.fixture(scope="module")
def tiny_server(embedded_server):
    return embedded_server(fresh=True, api_key=API_KEY, max_batch_size=8, max_model_len=256)  # its tests sleep it


@pytest.mark.skipif(not is_converted(smollm2.default_smollm2_dir()), reason="SmolLM2 not converted in the cache")
def test_sleep_returns_the_freed_memory_and_wake_gives_identical_greedy_output(embedded_server, smollm2_path):
    """Level 1 gives back at least the KV cache's resident blocks and the packed copies, level 2 the weights too
    (VmRSS of the server, 20 % slack); after each wake the greedy tokens and logprobs are those of before."""
    with embedded_server(fresh=True, model=smollm2_path, api_key=API_KEY, max_batch_size=4, max_model_len=1024) as dep:
        before = greedy(dep)
        for level in (1, 2):
            rss0 = server_rss_bytes(dep)
            status, out = call(dep, "POST", f"/sleep?level={level}")
            assert status == 200, out
            assert out["is_sleeping"] and out["level"] == level
            freed = out["freed"]
            expected = freed["kv_cache_bytes"] + freed["derived_bytes"] + freed["weight_bytes"]
            # the pool's resident part: the blocks handed out so far (one request's here; 720 KiB per 16 tokens)
            assert freed["kv_cache_bytes"] >= 30 * 3 * 16 * 64 * 2 * 4
            assert (freed["weight_bytes"] > 400 * 2**20) == (level == 2)  # 135M fp32 parameters
            dropped = rss0 - server_rss_bytes(dep)
            assert dropped >= 0.8 * expected, (level, dropped, freed)
            assert call(dep, "GET", "/is_sleeping")[1]["is_sleeping"] is True
            status, woke = call(dep, "POST", "/wake_up")
            assert status == 200 and woke["is_sleeping"] is False
            assert woke["reloaded_weights"] == (level == 2)  # no push followed: the model folder's weights
            assert greedy(dep) == before


def test_request_sent_while_asleep_waits_and_runs_after_wake(tiny_server):
    before = greedy(tiny_server)

    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(tiny_server.base_url + "/sleep?level=1") as r:
                assert r.status == 200
            body = {
                "prompt": PROMPT,
                "max_tokens": 10,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "logprobs": 0,
            }
            pending = asyncio.ensure_future(s.post(tiny_server.base_url + "/v1/completions", json=body))
            async with s.get(tiny_server.base_url + "/is_sleeping") as r:
                state = await r.json()
            assert state["is_sleeping"] and not pending.done()
            async with s.post(tiny_server.base_url + "/wake_up") as r:
                assert r.status == 200
            resp = await pending
            out = await resp.json()
            resp.release()
            c = out["choices"][0]
            return c["token_ids"], c["logprobs"]["token_logprobs"], c["weight_version"]

    assert asyncio.run(go()) == before


def test_sleep_endpoints_need_the_api_key_and_a_valid_level(tiny_server):
    for method, path in (("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping")):
        assert call(tiny_server, method, path, headers={})[0] == 401
    status, out = call(tiny_server, "POST", "/sleep?level=3")
    assert status == 400 and out["error"]["param"] == "level"
    assert call(tiny_server, "GET", "/is_sleeping")[1]["is_sleeping"] is False


def test_weight_push_to_a_level_2_sleeper_lands_and_is_served_after_wake(tiny_server, tiny_model_path):
    """The push refills the freed weights (the engine sleeps on at level 1); the wake serves them, no reload."""
    from training.deployment.engine.weights import load_safetensors
    from training.deployment.weights.files import WeightFolder

    before = greedy(tiny_server)
    counts = call(tiny_server, "GET", "/is_sleeping")[1]
    assert call(tiny_server, "POST", "/sleep?level=2")[0] == 200
    folder = WeightFolder("shm")
    try:
        folder.write(load_safetensors(tiny_model_path).items())
        tiny_server.load_weights(str(folder.folder), 7)
    finally:
        folder.remove()
    state = call(tiny_server, "GET", "/is_sleeping")[1]
    assert state["is_sleeping"] and state["level"] == 1
    status, woke = call(tiny_server, "POST", "/wake_up")
    assert status == 200 and woke["reloaded_weights"] is False and woke["weight_version"] == 7
    assert woke["sleeps"] == counts["sleeps"] + 1 and woke["wakes"] == counts["wakes"] + 1
    tokens, logprobs, version = greedy(tiny_server)
    # the same weights again: the same tokens; the logprobs to fp32 rounding (the update dropped the cached
    # prompt K/V, so the prompt is prefilled anew, in another batch than the one that cached it)
    assert (tokens, version) == (before[0], 7)
    assert logprobs == pytest.approx(before[1], abs=1e-5)


def test_colocate_trains_synchronously(tiny_model_path):
    cfg = async_rl_loop.Config(base_model=tiny_model_path, deployment=DeployConfig(colocate=True))
    assert cfg.trains_synchronously is True and cfg.synchronous_training is None  # decided, not rewritten
    with pytest.raises(ValueError, match="weight_sync_interval"):
        async_rl_loop.Config(
            base_model=tiny_model_path,
            deployment=DeployConfig(colocate=True, sleep_level=2),
            weight_sync_interval=2,
            max_head_offpolicy_versions=1,
        )


def test_colocated_async_rl_loop_sleeps_and_wakes_around_every_step(tiny_model_path, tmp_path):
    """Two steps with a launched, colocated server at sleep level 2: every step the server slept and woke once
    (its own counters), the push landed while it slept, and the served weight version advanced 1, 2."""
    from tests.recipes.test_recipes import Recorder

    cfg = async_rl_loop.Config(
        base_model=tiny_model_path,
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_tokens=4,
        max_steps=2,
        export_final_model=False,
        trainer=TrainerConfig(learning_rate=1e-3, device="cpu", offload_optimizer=True),
        loss=LossConfig(kl_beta=0.0),
        deployment=DeployConfig(
            colocate=True, sleep_level=2, engine_config=EngineConfig(device="cpu", max_batch_size=8, max_model_len=128)
        ),
    )
    rec = Recorder()
    out = async_rl_loop.main(
        cfg, rollout_fn_factory=rec, rows=[{"id": i, "prompt_ids": [1, 10 + i, 201]} for i in range(8)]
    )
    assert out["steps"] == 2
    rows = [r for r in read_metrics(tmp_path / "run") if "colocate/server_sleeps" in r]
    assert [r["colocate/server_sleeps"] for r in rows] == [1.0, 2.0]
    assert [r["colocate/server_wakes"] for r in rows] == [1.0, 2.0]
    assert all(r["colocate/freed_bytes"] > 0 for r in rows)
    assert [r["offpolicy/weight_version"] for r in rows] == [1.0, 2.0]
    assert sorted(set(rec.versions)) == [0, 1]  # step 2 sampled from the weights pushed while the server slept


@pytest.mark.parametrize("use_lean_forward", [True, False], ids=["lean", "hf_fallback"])
def test_engine_sleep_level_2_and_wake_on_either_runner_gives_identical_greedy_output(
    tiny_model_path, use_lean_forward
):
    """In-process: both runners free their KV cache and weights (the fallback's memory-mapped parameters
    are swapped out, not resized) and, with no push, wake on the model folder's weights at version 0."""
    from training.deployment.engine.async_engine import AsyncEngine
    from training.deployment.engine.requests import SamplingParams

    async def go():
        engine = AsyncEngine(
            EngineConfig(
                model=tiny_model_path,
                device="cpu",
                dtype="float32",
                max_batch_size=4,
                max_model_len=128,
                use_lean_forward=use_lean_forward,
            )
        )
        await engine.start()
        try:
            params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
            before = await engine.generate(PROMPT, params)
            freed = await engine.sleep(2)
            assert freed["kv_cache_bytes"] > 0 and freed["weight_bytes"] > 0 and engine.sleep_level == 2
            assert (await engine.wake_up())["reloaded_weights"] is True
            after = await engine.generate(PROMPT, params)
            assert engine.sleep_level == 0 and engine.weight_version == 0
            return before, after
        finally:
            await engine.shutdown()

    before, after = asyncio.run(go())
    assert after.output_token_ids == before.output_token_ids
    assert after.output_logprobs == before.output_logprobs


def test_colocated_vllm_is_launched_with_sleep_mode(tmp_path):
    """vLLM's /sleep, /wake_up, /is_sleeping need --enable-sleep-mode and VLLM_SERVER_DEV_MODE=1 (the command
    only: driving a real vLLM needs its GPU build, which this suite does not have)."""
    from training.deployment.backends.vllm import VLLMDeployment

    def launched(colocate):
        dep = VLLMDeployment(
            "/models/x", DeployConfig(engine="vllm", colocate=colocate), log_file=str(tmp_path / "v.log")
        )
        dep.port = 1234
        return dep._command(), dep._env()

    cmd, env = launched(True)
    assert "--enable-sleep-mode" in cmd and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-sleep-mode" not in launched(False)[0]
