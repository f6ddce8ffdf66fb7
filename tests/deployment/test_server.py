"""The deployment server over real HTTP: one server subprocess on the tiny model for the module, and one of
its own for the test that changes the weights (so no test depends on running before or after it).
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import aiohttp
import pytest
import torch

from tests.held_engine import HeldEngine
from training.deployment.engine.requests import GenerationResult
from training.deployment.group import push_weights
from training.deployment.server.protocol import ParsedRequest
from training.deployment.server.bodies import build_chat_response, parse_tool_calls
from training.deployment.weights.files import WeightSyncError, shm_dir

API_KEY = "test-key"
MAX_MODEL_LEN = 256
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SERVER = dict(api_key=API_KEY, served_model_name="tiny", max_model_len=MAX_MODEL_LEN, max_batch_size=16)


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, **SERVER)  # fresh: a test pauses it


def call(server, method, path, body=None, headers=AUTH, raw=None):
    """One HTTP request in a fresh event loop -> (status, json)."""

    async def go():
        async with aiohttp.ClientSession() as s:
            data = raw if raw is not None else (json.dumps(body) if body is not None else None)
            async with s.request(method, server.base_url + path, data=data, headers=headers) as r:
                return r.status, await r.json(content_type=None)

    return asyncio.run(go())


def complete(server, **body):
    status, out = call(server, "POST", "/v1/completions", {"model": "tiny", **body})
    assert status == 200, out
    return out


def greedy_ids(server, prompt, n_tokens=12):
    out = complete(server, prompt=prompt, max_tokens=n_tokens, temperature=0.0, ignore_eos=True, return_token_ids=True)
    return out["choices"][0]["token_ids"], out["choices"][0]["weight_version"]


PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


def test_ready_line_health_and_models(server):
    assert "DEPLOYMENT READY http://127.0.0.1:" in server.log_path.read_text()
    status, out = call(server, "GET", "/health", headers={})
    assert status == 200 and out["status"] == "ok" and out["weight_version"] == 0
    status, out = call(server, "GET", "/v1/models")
    assert status == 200
    assert out["data"][0]["id"] == "tiny" and out["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert call(server, "GET", "/weight_version")[1] == {"weight_version": 0, "dtype": "float32"}
    status, stats = call(server, "GET", "/stats")
    assert status == 200 and isinstance(stats, dict) and stats.get("paused") is False
    # the execution path build_runner chose (the C step where it builds on CPU fp32), logged once at start
    assert stats["execution_path"] in ("native", "torch") and stats["execution_path_reason"]
    assert f"engine path: {'native C decode step' if stats['execution_path'] == 'native' else 'lean forward'}" in (
        server.log_path.read_text()
    )
    assert stats["execution_path_reason"] in server.log_path.read_text()


@pytest.mark.parametrize(
    "path,method",
    [
        ("/v1/models", "GET"),
        ("/v1/completions", "POST"),
        ("/update_weights_from_shm", "POST"),
        ("/pause", "POST"),
        ("/weight_version", "GET"),
    ],
)
def test_api_key_required_everywhere_but_health(server, path, method):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, out = call(server, method, path, {"prompt": PROMPT}, headers=headers)
        assert status == 401 and out["error"]["type"] == "authentication_error"


def test_completion_token_ids_logprobs_usage_version(server):
    out = complete(server, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=1, return_token_ids=True)
    (ch,) = out["choices"]
    assert ch["prompt_token_ids"] == PROMPT
    assert 1 <= len(ch["token_ids"]) <= 8
    assert len(ch["logprobs"]["token_logprobs"]) == len(ch["token_ids"]) == len(ch["logprobs"]["tokens"])
    assert all(lp <= 0.0 for lp in ch["logprobs"]["token_logprobs"])
    assert ch["finish_reason"] in ("stop", "length")
    assert out["weight_version"] == ch["weight_version"] == 0
    u = out["usage"]
    assert u["prompt_tokens"] == len(PROMPT) and u["completion_tokens"] == len(ch["token_ids"])
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    assert u["prompt_tokens_details"]["cached_tokens"] == 0
    assert ch["token_weight_versions"] == [0] * len(ch["token_ids"])


def test_string_prompt_and_list_of_one_prompt(server):
    out = complete(server, prompt="the answer is", max_tokens=4, temperature=0.0, return_token_ids=True)
    assert len(out["choices"]) == 1 and isinstance(out["choices"][0]["text"], str)
    assert out["choices"][0]["logprobs"] is None  # not asked
    out2 = complete(server, prompt=[PROMPT], max_tokens=4, temperature=0.0, return_token_ids=True)
    assert out2["choices"][0]["prompt_token_ids"] == PROMPT


def test_n_choices_seeded_and_reproducible(server):
    body = dict(prompt=PROMPT, max_tokens=10, temperature=1.0, n=4, seed=7, ignore_eos=True, return_token_ids=True)
    a, b = complete(server, **body), complete(server, **body)
    ids_a = [c["token_ids"] for c in a["choices"]]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2, 3]
    assert ids_a == [c["token_ids"] for c in b["choices"]]  # seed + i per choice: reproducible
    assert len({tuple(x) for x in ids_a}) > 1  # ... and the choices differ
    single = complete(server, **{**body, "n": 1, "seed": 9})
    assert single["choices"][0]["token_ids"] == ids_a[2]  # choice i uses seed + i


def test_32_concurrent_requests_of_different_lengths(server):
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:

            async def one(i):
                body = {
                    "prompt": PROMPT[: 1 + i % 8] + [i + 20] * (i % 5),
                    "max_tokens": 1 + i,
                    "ignore_eos": True,
                    "temperature": 1.0,
                    "seed": i,
                    "return_token_ids": True,
                    "logprobs": 0,
                }
                async with s.post(server.base_url + "/v1/completions", json=body) as r:
                    assert r.status == 200
                    return i, await r.json()

            return await asyncio.gather(*[one(i) for i in range(32)])

    t0 = time.perf_counter()
    results = asyncio.run(go())
    elapsed = time.perf_counter() - t0
    for i, out in results:
        ch = out["choices"][0]
        assert len(ch["token_ids"]) == 1 + i and ch["finish_reason"] == "length"
        assert len(ch["logprobs"]["token_logprobs"]) == 1 + i
    total = sum(1 + i for i in range(32))
    print(f"32 concurrent requests, {total} tokens in {elapsed:.2f} s ({total / elapsed:.0f} tok/s)")


BAD_COMPLETIONS = [
    ({"prompt": PROMPT, "max_tokens": "8"}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": [1, 2, 10**6]}, "prompt"),
    ({"prompt": [1, -2, 3]}, "prompt"),
    ({"prompt": [1, 2.5]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": None}, "prompt"),
    ({}, "prompt"),
    ({"prompt": PROMPT, "temperature": -0.5}, "temperature"),
    ({"prompt": PROMPT, "temperature": "hot"}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "n": 1.5}, "n"),
    ({"prompt": PROMPT, "stop": 5}, "stop"),
    ({"prompt": PROMPT, "seed": "x"}, "seed"),
    ({"prompt": PROMPT, "logprobs": "yes"}, "logprobs"),
    ({"prompt": PROMPT, "return_token_ids": "yes"}, "return_token_ids"),
    ({"prompt": PROMPT, "stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"prompt": list(range(1, MAX_MODEL_LEN + 1))}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[p + str(i) for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_input_is_400_naming_the_field(server, body, param):
    status, out = call(server, "POST", "/v1/completions", body)
    assert status == 400, out
    assert out["error"]["type"] == "invalid_request_error" and out["error"]["param"] == param, out
    assert out["error"]["message"]
    assert complete(server, prompt=PROMPT, max_tokens=2)["choices"]  # still serving


@pytest.mark.parametrize(
    "body,param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": "calc"}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}, "max_tokens"),
    ],
)
def test_bad_chat_input_is_400_naming_the_field(server, body, param):
    status, out = call(server, "POST", "/v1/chat/completions", body)
    assert status == 400 and out["error"]["param"] == param, out


def test_malformed_json_non_object_body_and_model_names(server, tiny_model_path):
    for raw in ("{not json", "[1, 2]", "3"):
        status, out = call(server, "POST", "/v1/completions", raw=raw)
        assert status == 400 and out["error"]["type"] == "invalid_request_error", out
    status, out = call(server, "POST", "/v1/completions", {"model": "other-model", "prompt": PROMPT})
    assert status == 404 and out["error"]["param"] == "model"
    for alias in ("tiny", "tiny-qwen3", tiny_model_path):  # served name, folder name, the --model value
        assert complete(server, model=alias, prompt=PROMPT, max_tokens=1)["model"] == "tiny"
    assert complete(server, prompt=PROMPT, max_tokens=2)["choices"]


def test_openai_client_completions_and_chat(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0.0,
        logprobs=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    ch = r.choices[0]
    assert len(ch.logprobs.token_logprobs) == 6 and len(ch.model_extra["token_ids"]) == 6
    assert ch.model_extra["prompt_token_ids"] == PROMPT and r.model_extra["weight_version"] == 0
    assert r.usage.completion_tokens == 6
    c = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "add 2 and 3"}],
        max_tokens=5,
        logprobs=True,
        temperature=0.0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    cc = c.choices[0]
    assert len(cc.logprobs.content) == len(cc.model_extra["token_ids"]) == 5
    assert isinstance(cc.message.content, str) and cc.message.role == "assistant"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=-1.0)
    assert "temperature" in str(e.value)


def test_chat_renders_template_with_tools(server, tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 3"}]
    status, out = call(
        server,
        "POST",
        "/v1/chat/completions",
        {
            "messages": messages,
            "tools": tools,
            "max_tokens": 4,
            "logprobs": True,
            "return_token_ids": True,
            "temperature": 0.0,
        },
    )
    assert status == 200, out
    expected = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert out["prompt_token_ids"] == expected == out["choices"][0]["prompt_token_ids"]
    assert "calculator" in tok.decode(expected)
    assert [e["logprob"] for e in out["choices"][0]["logprobs"]["content"]] and out["weight_version"] == 0
    ch = out["choices"][0]
    assert ch["token_weight_versions"] == [0] * len(ch["token_ids"])


def test_tool_call_blocks_become_openai_tool_calls():
    text = 'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
    content, calls = parse_tool_calls(
        text + ' <tool_call>{"name": "x", "arguments": "{}"}</tool_call> bad: <tool_call>{not json}</tool_call>'
    )
    assert [c["function"]["name"] for c in calls] == ["calculator", "x"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"expression": "2+3"}
    assert calls[1]["function"]["arguments"] == "{}" and calls[0]["type"] == "function" and calls[0]["id"]
    assert content.startswith("Let me compute. <tool_call>")  # a malformed block: the whole reply stays visible
    content, calls = parse_tool_calls(text + " done")
    assert content == "Let me compute.  done"  # the text outside the block
    assert len(calls) == 1 and calls[0]["id"] != parse_tool_calls(text)[1][0]["id"]  # ids unique per response
    assert parse_tool_calls("plain answer") == ("plain answer", [])
    from training.deployment.engine.requests import SamplingParams

    req = ParsedRequest(
        prompts=[[1, 2]],
        n=1,
        params=SamplingParams(),
        seed=None,
        logprobs=0,
        return_token_ids=True,
        model="tiny",
        tools=[{"type": "function"}],
        parse_tool_calls=True,
    )
    res = GenerationResult([1, 2], [5, 6], [-0.1, -0.2], "stop", 4, 0, text)

    class Tok:
        def decode(self, ids):
            return f"<{ids[0]}>"

    out = build_chat_response(req, [res], Tok())
    ch = out["choices"][0]
    assert ch["finish_reason"] == "tool_calls" and ch["message"]["content"] == "Let me compute."
    assert ch["message"]["tool_calls"][0]["function"]["name"] == "calculator"
    assert ch["token_ids"] == [5, 6] and [e["logprob"] for e in ch["logprobs"]["content"]] == [-0.1, -0.2]
    assert out["weight_version"] == ch["weight_version"] == 4


def test_sampled_logprobs_match_transformers_forward(server, tiny_model_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    out = complete(
        server,
        prompt=PROMPT,
        max_tokens=24,
        temperature=1.0,
        seed=11,
        n=2,
        ignore_eos=True,
        logprobs=0,
        return_token_ids=True,
    )
    worst = 0.0
    for ch in out["choices"]:
        ids = torch.tensor([PROMPT + ch["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
        ref = logp[len(PROMPT) - 1 : -1].gather(1, torch.tensor(ch["token_ids"])[:, None])[:, 0]
        worst = max(worst, (ref - torch.tensor(ch["logprobs"]["token_logprobs"])).abs().max().item())
    print(f"max |server - transformers| logprob = {worst:.2e}")
    assert worst < 1e-4


def test_session_reuses_kv_on_the_next_turn(server):
    headers = {**AUTH, "x-multi-turn-session-id": "session-a"}
    fresh = [61, 62, 63, 64, 65, 66, 67]  # no other test sent it: nothing of it is cached yet
    s1, out1 = call(
        server,
        "POST",
        "/v1/completions",
        {"prompt": fresh, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True},
        headers,
    )
    assert s1 == 200 and out1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = fresh + out1["choices"][0]["token_ids"] + [30, 31, 32]
    s2, out2 = call(
        server, "POST", "/v1/completions", {"prompt": turn2, "max_tokens": 4, "return_token_ids": True}, headers
    )
    assert s2 == 200
    cached = out2["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < len(turn2), out2["usage"]


def _concurrent_completions(server, bodies: list[dict]) -> list[dict]:
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:

            async def one(body):
                async with s.post(server.base_url + "/v1/completions", json={"model": "tiny", **body}) as r:
                    assert r.status == 200
                    return await r.json()

            return await asyncio.gather(*[one(b) for b in bodies])

    return asyncio.run(go())


def test_grpo_group_over_http_computes_its_prompt_once_and_reports_cached_tokens(server):
    prompt = [300 + (7 * i) % 97 for i in range(40)]  # fresh: no other test sent it
    before = call(server, "GET", "/stats")[1]
    outs = _concurrent_completions(
        server,
        [
            {
                "prompt": prompt,
                "max_tokens": 5,
                "temperature": 1.0,
                "seed": i,
                "ignore_eos": True,
                "return_token_ids": True,
            }
            for i in range(8)
        ],
    )
    after = call(server, "GET", "/stats")[1]
    cached = sorted(o["usage"]["prompt_tokens_details"]["cached_tokens"] for o in outs)
    assert cached[0] == 0 and all(c >= len(prompt) - 1 for c in cached[1:])  # one member computed it
    assert after["prefill_tokens"] - before["prefill_tokens"] <= len(prompt) + 7
    assert after["cached_prompt_tokens"] - before["cached_prompt_tokens"] == sum(cached)
    # n > 1 on a fresh prompt: the prompt is computed once, the request reports what that computation reused
    fresh = [400 + (11 * i) % 89 for i in range(30)]
    before = call(server, "GET", "/stats")[1]
    out = complete(server, prompt=fresh, n=4, max_tokens=3, temperature=1.0, seed=1, return_token_ids=True)
    after = call(server, "GET", "/stats")[1]
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert after["prefill_tokens"] - before["prefill_tokens"] <= len(fresh) + 3
    again = complete(server, prompt=fresh, n=2, max_tokens=3, temperature=1.0, seed=5, return_token_ids=True)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(fresh) - 1


def test_pause_holds_requests_until_resume(server):
    async def go():
        async with aiohttp.ClientSession(headers=AUTH) as s:
            async with s.post(server.base_url + "/pause") as r:
                assert r.status == 200
            task = asyncio.ensure_future(
                s.post(server.base_url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3})
            )
            await asyncio.sleep(0.5)
            held = not task.done()
            async with s.post(server.base_url + "/resume") as r:
                assert r.status == 200
            resp = await asyncio.wait_for(task, 30)
            status = resp.status
            resp.release()
            return held, status

    held, status = asyncio.run(go())
    assert held and status == 200


# ---- weight updates: the test that changes them has a server of its own ----


def _perturbed(model_path: str, scale: float = 2.0) -> dict[str, torch.Tensor]:
    """The model's tensors plus noise (norm weights get absolute noise: their std is 0)."""
    from safetensors.torch import load_file

    tensors = load_file(f"{model_path}/model.safetensors")
    g = torch.Generator().manual_seed(0)
    return {
        k: v + torch.randn(v.shape, generator=g) * (scale if "norm" in k else scale * v.float().std())
        for k, v in tensors.items()
    }


def _hf_greedy(model_path: str, tensors: dict[str, torch.Tensor], prompt: list[int], n_tokens: int = 12):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    model.load_state_dict(tensors, strict=False)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n_tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def test_weight_update_changes_greedy_output_and_version(embedded_server, tiny_model_path, tmp_path):
    server = embedded_server(fresh=True, **SERVER)  # its own: the pushes change its weights and version
    before, v0 = greedy_ids(server, PROMPT)
    assert v0 == 0
    new = _perturbed(tiny_model_path)
    timing = asyncio.run(push_weights(server.base_url, new.items(), 1, api_key=API_KEY))
    print(f"shm weight push: write {timing['write_s']:.3f} s, load {timing['load_s']:.3f} s")
    assert not os.path.exists(timing["path"])  # the shm file is removed once the server has loaded it
    assert not list(shm_dir().glob(f"training-weights-{os.getpid()}-v1-*"))
    after, v1 = greedy_ids(server, PROMPT)
    assert v1 == 1 and after != before
    assert after == _hf_greedy(tiny_model_path, new, PROMPT)  # the server runs exactly the pushed weights
    assert call(server, "GET", "/weight_version")[1]["weight_version"] == 1
    # back to the original weights through the disk path: the original greedy output returns
    from safetensors.torch import load_file

    original = load_file(f"{tiny_model_path}/model.safetensors")
    asyncio.run(
        push_weights(server.base_url, original.items(), 2, mode="disk", directory=str(tmp_path / "w"), api_key=API_KEY)
    )
    again, v2 = greedy_ids(server, PROMPT)
    assert v2 == 2 and again == before


def test_in_flight_update_over_http_labels_every_token_with_its_version(tiny_model_path):
    n = 200

    async def go():
        async with HeldEngine(tiny_model_path, hold_after=20) as held, aiohttp.ClientSession() as s:
            v = held.eng.weight_version
            body = {
                "prompt": PROMPT,
                "max_tokens": n,
                "temperature": 0.0,
                "ignore_eos": True,
                "return_token_ids": True,
                "logprobs": 0,
            }
            long = asyncio.ensure_future(s.post(held.base_url + "/v1/completions", json=body))
            await held.pause_when_held()  # held mid-sequence: the push lands between two steps
            await push_weights(held.base_url, _perturbed(tiny_model_path).items(), v + 1, wait_for_inflight=False)
            await held.eng.resume()
            async with await long as r:
                assert r.status == 200
                return v, await r.json()

    v, out = asyncio.run(go())
    ch = out["choices"][0]
    versions = ch["token_weight_versions"]
    assert len(versions) == len(ch["token_ids"]) == n
    k = versions.index(v + 1)
    assert 20 <= k < n and versions == [v] * k + [v + 1] * (n - k)
    assert ch["weight_version"] == out["weight_version"] == v  # the oldest among its tokens


def test_refused_update_keeps_old_weights(server, tiny_model_path):
    before, v = greedy_ids(server, PROMPT)
    bad = _perturbed(tiny_model_path)
    name = next(k for k in bad if k.endswith("q_proj.weight"))
    bad[name] = bad[name][:, :-1].contiguous()  # wrong shape
    with pytest.raises(WeightSyncError) as e:
        asyncio.run(push_weights(server.base_url, bad.items(), v + 1, api_key=API_KEY))
    assert "400" in str(e.value) and name in str(e.value)
    after, v_after = greedy_ids(server, PROMPT)
    assert v_after == v and after == before
    status, out = call(server, "POST", "/update_weights_from_shm", {"path": "/etc/passwd", "weight_version": 9})
    assert status == 400 and out["error"]["param"] == "path"
    status, out = call(server, "POST", "/update_weights_from_disk", {"path": "/nonexistent", "weight_version": "9"})
    assert status == 400 and out["error"]["param"] == "weight_version"
