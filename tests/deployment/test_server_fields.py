"""Every request field is honoured or refused (400 naming it), and no request can fail another.

One server subprocess on the tiny model for the module, over real HTTP.
"""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from training.deployment.server.fields import HONOURED, METADATA, UNSUPPORTED

PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
CHAT = [{"role": "user", "content": "what is 2 + 3"}]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_model_len=256, max_batch_size=16)


async def _post(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[int, dict]:
    async with session.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}) as r:
        text = await r.text()
        # strict JSON: a NaN or Infinity in an answer would break most clients
        return r.status, json.loads(text, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}"))


def post(server, path: str, body: dict) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            return await _post(s, server.base_url + path, body)

    return asyncio.run(go())


def completion_ids(server, **body) -> list[int]:
    status, out = post(server, "/v1/completions", {"prompt": PROMPT, "return_token_ids": True, **body})
    assert status == 200, out
    return out["choices"][0]["token_ids"]


REFUSED = [
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "x"}, "suffix"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat", {"prompt_logprobs": 1}, "prompt_logprobs"),  # honoured on completions only
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("completions", {"max_tokens": 0}, "max_tokens"),  # 0 only with prompt_logprobs
    ("completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("completions", {"guided_json": {"type": "object"}}, "guided_json"),
    ("completions", {"skip_special_tokens": False}, "skip_special_tokens"),
    ("completions", {"typical_p": 0.5}, "typical_p"),  # unknown: another server's sampling field
    ("completions", {"tools": []}, "tools"),  # a chat field on completions
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),  # without stream
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("completions", {"logit_bias": {"5": 101}}, "logit_bias"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias"),
    ("completions", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"min_p": 1.5}, "min_p"),
    ("completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"frequency_penalty": -9}, "frequency_penalty"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"min_tokens": 17}, "min_tokens"),  # > max_tokens (16 by default)
    ("completions", {"logprobs": 21}, "logprobs"),
    ("completions", {"temperature": float("nan")}, "temperature"),
    ("completions", {"top_p": float("inf")}, "top_p"),
    ("completions", {"seed": 2**64}, "seed"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    (
        "completions",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "frob"}}}},
        "response_format",
    ),
    ("chat", {"tool_choice": "required"}, "tool_choice"),  # without tools
    ("chat", {"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice"),  # not in tools
    ("chat", {"parallel_tool_calls": False}, "parallel_tool_calls"),
    ("chat", {"functions": [{"name": "f"}]}, "functions"),
    ("chat", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("chat", {"chat_template_kwargs": {"chat_template": "{{ messages }}"}}, "chat_template_kwargs"),
    ("chat", {"reasoning_effort": "high"}, "reasoning_effort"),
    ("chat", {"prompt": PROMPT}, "prompt"),  # a completions field on chat
    ("chat", {"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ("chat", {"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt
]


@pytest.mark.parametrize("endpoint, extra, param", REFUSED, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(REFUSED)])
def test_unimplemented_or_out_of_range_field_is_400_naming_it(server, endpoint, extra, param):
    path, base = (
        ("/v1/completions", {"prompt": PROMPT})
        if endpoint == "completions"
        else ("/v1/chat/completions", {"messages": CHAT})
    )
    status, out = post(server, path, {**base, "max_tokens": 4, **extra})
    assert status == 400, out
    assert out["error"]["param"] == param and out["error"]["type"] == "invalid_request_error", out
    assert param in out["error"]["message"]


def test_defaults_of_unsupported_fields_and_metadata_are_accepted(server):
    harmless = {
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "echo": False,
        "best_of": 2,
        "n": 2,
        "suffix": None,
        "skip_special_tokens": True,
        "length_penalty": 1.0,
        "priority": 0,
        "response_format": {"type": "text"},
    }
    status, out = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3, **harmless})
    assert status == 200 and len(out["choices"]) == 2, out
    chat = {
        "messages": CHAT,
        "max_tokens": 3,
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "modalities": ["text"],
        "service_tier": "auto",
    }
    status, out = post(server, "/v1/chat/completions", chat)
    assert status == 200, out


def test_field_tables_do_not_overlap():
    for endpoint, names in HONOURED.items():
        assert not names & METADATA and not names & set(UNSUPPORTED), endpoint


def test_top_k_1_at_temperature_1_returns_the_greedy_tokens(server):
    greedy = completion_ids(server, max_tokens=10, temperature=0.0, ignore_eos=True)
    for seed in range(3):
        assert completion_ids(server, max_tokens=10, temperature=1.0, top_k=1, seed=seed, ignore_eos=True) == greedy
    assert completion_ids(server, max_tokens=10, temperature=1.0, seed=0, ignore_eos=True) != greedy


def test_honoured_fields_change_the_output(server):
    greedy = completion_ids(server, max_tokens=8, temperature=0.0, ignore_eos=True)  # the tiny model repeats
    assert completion_ids(server, max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={"9": 100}) == [9] * 8
    assert (
        len(
            set(
                completion_ids(
                    server, max_tokens=8, temperature=0.0, ignore_eos=True, presence_penalty=2.0, repetition_penalty=3.0
                )
            )
        )
        > 1
    )
    ids = completion_ids(server, max_tokens=8, temperature=0.0, stop_token_ids=[greedy[0]], min_tokens=3)
    assert greedy[0] not in ids[:3] and len(ids) > 3
    status, out = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 4, "stop_token_ids": [greedy[0]], "temperature": 0.0},
    )
    assert out["choices"][0]["stop_reason"] == greedy[0] and out["choices"][0]["finish_reason"] == "stop"
    status, out = post(
        server,
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 3, "logprobs": 4, "return_tokens_as_token_ids": True, "temperature": 0.0},
    )
    lp = out["choices"][0]["logprobs"]
    assert all(len(top) == 4 for top in lp["top_logprobs"])  # the sampled (greedy) token is among the 4
    assert all(t.startswith("token_id:") for top in lp["top_logprobs"] for t in top)
    assert lp["tokens"][0] == f"token_id:{greedy[0]}"
    status, out = post(
        server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 3, "logprobs": True, "top_logprobs": 3}
    )
    content = out["choices"][0]["logprobs"]["content"]
    assert all(len(e["top_logprobs"]) == 3 for e in content)
    assert all(e["top_logprobs"][0]["logprob"] >= e["top_logprobs"][2]["logprob"] for e in content)


# ---------------------------------------------------------------- fuzz

POOLS = {  # valid extremes (sampled robustly) and invalid values (400), mixed
    "temperature": [0, 1e-30, 1e-45, 5e-324, 1e-8, 1e30, 1e300, -1, float("nan"), float("inf"), 0.7, "hot"],
    "top_p": [1e-46, 1e-300, 5e-324, 1e-8, 0, -0.5, 1.0000001, 0.3, 1, float("nan")],
    "top_k": [-2, -1, 0, 1, 2, 10**9, 1.5],
    "min_p": [0, 1e-40, 0.5, 0.999, 1, 1.5, -0.1],
    "logit_bias": [
        {"0": 100},
        {"0": 1e30},
        {"5": -100, "6": 100},
        {"99999": 1},
        {"x": 1},
        {"3": float("nan")},
        {str(t): 100 for t in range(512)},
        {str(t): -100 for t in range(512)},
    ],
    "presence_penalty": [-2, 2, 1e10, float("-inf")],
    "frequency_penalty": [-2, 2, -1e10],
    "repetition_penalty": [0, 1e-30, 0.01, 100, 1e10],
    "min_tokens": [0, 3, 10**6, -1],
    "seed": [0, 2**62, -5, 2**64, -(2**63) - 1],
}


def test_fuzzed_sampling_fields_never_fail_another_request_or_return_5xx(server):
    rng = random.Random(20261124)
    valid = [({"prompt": PROMPT[:k], "max_tokens": 12, "temperature": 0.0, "ignore_eos": True},) for k in (3, 5, 8)]
    valid += [
        ({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.0, "seed": s, "ignore_eos": True, "logprobs": 0},)
        for s in (1, 2)
    ]
    expected = [completion_ids(server, **body) for (body,) in valid]
    fuzzed = []
    for _ in range(64):
        body = {"prompt": PROMPT, "max_tokens": rng.choice([4, 12]), "ignore_eos": True, "logprobs": 2}
        for name in rng.sample(sorted(POOLS), rng.randint(1, 3)):
            body[name] = rng.choice(POOLS[name])
        fuzzed.append(body)

    async def go():
        async with aiohttp.ClientSession() as s:
            url = server.base_url + "/v1/completions"
            jobs = [_post(s, url, {**body, "return_token_ids": True}) for (body,) in valid] * 2
            jobs += [_post(s, url, body) for body in fuzzed]
            order = list(range(len(jobs)))
            rng.shuffle(order)
            done = await asyncio.gather(*[jobs[i] for i in order])
            return [done[order.index(i)] for i in range(len(jobs))]

    answers = asyncio.run(go())
    n_valid = 2 * len(valid)
    for i, (status, out) in enumerate(answers[:n_valid]):
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == expected[i % len(valid)]
    statuses = [status for status, _ in answers[n_valid:]]
    print(f"fuzz: {statuses.count(200)} served, {statuses.count(400)} refused")
    assert all(s in (200, 400) for s in statuses), statuses
    assert 5 < statuses.count(200) and 5 < statuses.count(400), statuses  # both kinds were exercised
    for (status, out), body in zip(answers[n_valid:], fuzzed):
        if status == 400:
            assert out["error"]["param"] in POOLS, (body, out)
        else:
            lp = out["choices"][0]["logprobs"]["token_logprobs"]
            assert len(lp) == body["max_tokens"] and all(x <= 0 for x in lp), (body, out)
    status, stats = post_get(server, "/stats")
    assert stats["requests_failed"] == 0 and stats["running"] == 0


def post_get(server, path: str) -> tuple[int, dict]:
    async def go():
        async with aiohttp.ClientSession() as s:
            async with s.get(server.base_url + path) as r:
                return r.status, await r.json()

    return asyncio.run(go())
