"""Constrained decoding over real HTTP on the tiny model: forced tool calls, JSON response formats, and the
reported logprob checked against a recomputation (transformers forward + the same grammar mask).

A random tiny model writes valid output only because of the constraint. Schemas bound every string and
number (maxLength, enum), so a sampled document ends well within ``max_tokens``.
"""

from __future__ import annotations

import json

import pytest
import requests
import torch

from training.deployment.engine.constraints import missing_library

CHAT = [{"role": "user", "content": "what is the weather in Paris"}]
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 6}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"enum": ["utc", "cet"]}, "hours": {"enum": [1, 2, 3]}},
    "required": ["zone", "hours"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no"]},
        "score": {"enum": [0, 1, 2]},
        "note": {"type": "string", "maxLength": 5},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["answer", "score", "note", "tags"],
    "additionalProperties": False,
}

needs_library = pytest.mark.skipif(missing_library() is not None, reason="llguidance (training[constrained]) missing")


def _matches(value, schema: dict) -> bool:
    """The subset of JSON schema used here: object (required, additionalProperties false), enum, string
    maxLength, array of items with maxItems."""
    if "enum" in schema:
        return value in schema["enum"] and type(value) in {type(e) for e in schema["enum"]}
    kind = schema["type"]
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "array":
        return (
            isinstance(value, list)
            and len(value) <= schema.get("maxItems", len(value))
            and all(_matches(v, schema["items"]) for v in value)
        )
    props = schema["properties"]
    return (
        isinstance(value, dict)
        and set(schema["required"]) <= set(value) <= set(props)
        and all(_matches(v, props[k]) for k, v in value.items())
    )


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_model_len=1024, max_batch_size=8)


def chat(server, **body) -> dict:
    r = requests.post(server.base_url + "/v1/chat/completions", json={"messages": CHAT, **body}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@needs_library
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_returns_one_valid_call_of_a_given_tool(server, seed):
    out = chat(server, tools=TOOLS, tool_choice="required", max_tokens=200, temperature=1.0, seed=seed)
    choice = out["choices"][0]
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and len(calls) == 1, choice
    fn = calls[0]["function"]
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[fn["name"]]
    assert _matches(json.loads(fn["arguments"]), schema), fn


@needs_library
@pytest.mark.parametrize("name", ["get_weather", "get_time"])
def test_named_tool_choice_returns_that_tool(server, name):
    choice = {"type": "function", "function": {"name": name}}
    for seed in range(3):
        out = chat(server, tools=TOOLS, tool_choice=choice, max_tokens=200, seed=seed)
        calls = out["choices"][0]["message"]["tool_calls"]
        assert [c["function"]["name"] for c in calls] == [name], out
        schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[name]
        assert _matches(json.loads(calls[0]["function"]["arguments"]), schema)


@needs_library
def test_response_format_json_schema_returns_json_that_validates(server):
    fmt = {"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA, "strict": True}}
    for seed in range(4):
        out = chat(server, response_format=fmt, max_tokens=200, temperature=1.2, seed=seed)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert _matches(json.loads(choice["message"]["content"]), SCHEMA), choice


@needs_library
def test_response_format_json_object_starts_an_object_and_parses_when_finished(server):
    out = chat(server, response_format={"type": "json_object"}, max_tokens=120, n=4, seed=3)
    for choice in out["choices"]:
        text = choice["message"]["content"]
        assert text.startswith("{"), text
        if choice["finish_reason"] == "stop":
            assert isinstance(json.loads(text), dict)


@needs_library
def test_completions_honour_response_format(server):
    body = {
        "prompt": "answer:",
        "max_tokens": 200,
        "seed": 5,
        "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
    }
    r = requests.post(server.base_url + "/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert _matches(json.loads(r.json()["choices"][0]["text"]), SCHEMA)


@needs_library
@needs_library
def test_a_forced_tool_call_with_a_json_format_is_the_forced_call(server):
    """OpenAI's meaning (openai-agents sends both for an agent with output_type and a forced tool_choice): the
    reply is the forced call; the format governs text replies. A format that does not compile is still a 400."""
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    r = requests.post(server.base_url + "/v1/chat/completions", json={**body, "max_tokens": 200, "seed": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "tool_calls"
    bad = {**body, "response_format": {"type": "json_schema", "json_schema": {"schema": "not a schema"}}}
    r = requests.post(server.base_url + "/v1/chat/completions", json=bad, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


@needs_library
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_constrained_logprobs_are_the_masked_distribution_recomputed(server, tiny_model_path, temperature):
    """Each returned logprob equals log_softmax(masked logits / T) from a transformers forward over the returned
    tokens, with the mask from re-running the grammar over them (and differs from the unmasked one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from training.deployment.engine.constraints import Constraint, GrammarMasks
    from training.deployment.server.structured import TOOL_CALL_PREFIX, TOOL_CALL_SUFFIX, tool_choice

    _, constraint = tool_choice({"tool_choice": "required"}, TOOLS)
    assert constraint.prefix == TOOL_CALL_PREFIX and constraint.suffix == TOOL_CALL_SUFFIX
    cases = [
        ({"tools": TOOLS, "tool_choice": "required"}, constraint),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, Constraint(SCHEMA)),
    ]
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    gen_eos = model.generation_config.eos_token_id
    eos = {tok.eos_token_id, *(gen_eos if isinstance(gen_eos, list) else [gen_eos])} - {None}
    differs = 0
    for fields, cons in cases:
        out = chat(
            server, **fields, max_tokens=200, temperature=temperature, seed=11, logprobs=True, return_token_ids=True
        )
        choice = out["choices"][0]
        prompt, ids = out["prompt_token_ids"], choice["token_ids"]
        returned = torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]], dtype=torch.float64)
        assert len(returned) == len(ids) > 5
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        masks = GrammarMasks(tok, logits.shape[-1])
        matcher = masks.matcher(cons, frozenset(eos))
        allowed = []
        for t in ids:
            allowed.append(matcher.allowed())
            assert allowed[-1][t], f"token {t} was outside the grammar"
            matcher.advance(t)
        masked = logits.masked_fill(~torch.stack(allowed), float("-inf"))
        expect = torch.log_softmax(masked / temperature, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        plain = torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(ids)[:, None]).squeeze(1)
        torch.testing.assert_close(returned, expect.double(), atol=1e-4, rtol=0)
        differs += int((plain.double() - returned).abs().max() > 1e-2)
    assert differs == len(cases)  # the unmasked logprob would have been wrong


@pytest.mark.skipif(missing_library() is None, reason="llguidance is installed")
def test_without_the_library_a_constrained_request_is_400_naming_the_package(server):
    body = {"messages": CHAT, "response_format": {"type": "json_object"}}
    r = requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and "llguidance" in r.json()["error"]["message"], r.text


@needs_library
def test_an_unconstrained_request_samples_the_same_tokens_beside_constrained_ones(server):
    """The mask touches only its own rows: a seeded plain request gives the same tokens and logprobs alone and
    batched with constrained requests (which also send the batch to the torch sampler)."""
    from concurrent.futures import ThreadPoolExecutor

    plain = {"max_tokens": 24, "seed": 7, "logprobs": True, "return_token_ids": True, "ignore_eos": True}
    alone = chat(server, **plain)["choices"][0]
    fmt = {"type": "json_schema", "json_schema": {"schema": SCHEMA}}
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(chat, server, response_format=fmt, max_tokens=200, seed=s) for s in range(3)]
        futures.append(pool.submit(chat, server, **plain))
        together = [f.result() for f in futures][-1]["choices"][0]
    assert together["token_ids"] == alone["token_ids"]
    got = [e["logprob"] for e in together["logprobs"]["content"]]
    want = [e["logprob"] for e in alone["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-4


@needs_library
def test_a_streamed_forced_tool_call_arrives_as_tool_call_deltas(server):
    body = {"messages": CHAT, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200, "seed": 4, "stream": True}
    names, arguments, finish = [], "", None
    with requests.post(server.base_url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            for call in choice["delta"].get("tool_calls") or []:
                names += [call["function"]["name"]] if call["function"].get("name") else []
                arguments += call["function"].get("arguments") or ""
            finish = choice.get("finish_reason") or finish
    assert finish == "tool_calls" and len(names) == 1, (names, arguments, finish)
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[names[0]]
    assert _matches(json.loads(arguments), schema)
