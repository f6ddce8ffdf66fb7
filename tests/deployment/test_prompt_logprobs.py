"""Prompt logprobs: the embedded server scores given token sequences (vLLM's ``prompt_logprobs``) as a
``transformers`` forward does, in vLLM's wire format, apart from the KV cache.

One server subprocess on the tiny model for the module, over real HTTP; the engine in process for the
execution paths the server does not take by default.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from training.deployment.client import DeploymentRequestError, DeploymentSampler
from training.utils import EngineConfig

SEQUENCES = [[5, 17, 42, 99, 7, 3, 250, 11, 64, 2], [1, 2], [300], list(range(40, 110))]
"""Token sequences to score: several lengths, one with nothing to score (a single token)."""


def hf_full_logprobs(model_path: str, seq: list[int]) -> torch.Tensor:
    """log_softmax over the vocabulary at each position t < len(seq) - 1 of a transformers fp32 forward, float64."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([seq[:-1]])).logits[0].double()
    return torch.log_softmax(logits, dim=-1)


def hf_logprobs(model_path: str, seq: list[int]) -> torch.Tensor:
    """log p(seq[t] | seq[:t]) for t >= 1 from a transformers fp32 forward, float64."""
    return hf_full_logprobs(model_path, seq)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(max_model_len=128, max_batch_size=8)


def call(server, method: str, *args, **kw):
    """``DeploymentSampler(server).<method>(*args, **kw)`` in a fresh event loop, the session closed after."""
    sampler = DeploymentSampler(server.base_url)

    async def go():
        try:
            return await getattr(sampler, method)(*args, **kw)
        finally:
            await sampler.close()

    return asyncio.run(go())


def request(server, body: dict) -> dict:
    return call(server, "request", "POST", "/v1/completions", body)


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_server_prompt_logprobs_equal_a_transformers_forward(server, tiny_model_path, max_tokens):
    """Every scored token's logprob is a transformers fp32 forward's (<= 1e-4), top-k and ranks included."""
    scored = call(server, "prompt_logprobs", SEQUENCES, top_k=3, max_tokens=max_tokens)
    assert [s.token_ids for s in scored] == SEQUENCES
    for seq, s in zip(SEQUENCES, scored):
        assert len(s.logprobs) == len(seq) and s.logprobs[0] is None and s.weight_version == 0
        if len(seq) < 2:
            continue
        full = hf_full_logprobs(tiny_model_path, seq)
        ref = full[torch.arange(len(seq) - 1), torch.tensor(seq[1:])]
        got = torch.tensor(s.logprobs[1:], dtype=torch.float64)
        assert (got - ref).abs().max().item() <= 1e-4
        for t in range(1, len(seq)):
            best = torch.topk(full[t - 1], 3).indices.tolist()
            assert set(best) <= set(s.top_logprobs[t]) and seq[t] in s.top_logprobs[t]


def test_prompt_logprobs_have_vllms_wire_shape(server, tiny_model_path):
    """``choices[].prompt_logprobs``: None first, then per token a dict keyed by token id (a string in JSON) of
    ``{logprob, rank, decoded_token}``: the prompt's token first, then the k likeliest, ranks from 1."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seq = SEQUENCES[0]
    out = request(server, {"prompt": seq, "prompt_logprobs": 2, "max_tokens": 2, "return_token_ids": True})
    (choice,) = out["choices"]
    assert len(choice["token_ids"]) == 2  # generation still runs beside the scoring
    entries = choice["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(seq)
    full = hf_full_logprobs(tiny_model_path, seq)
    for t in range(1, len(seq)):
        entry = entries[t]
        first = next(iter(entry))
        assert first == str(seq[t]) and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        row = full[t - 1]
        assert entry[first]["rank"] == int((row > row[seq[t]]).sum()) + 1
        assert len(entry) == (2 if entry[first]["rank"] <= 2 else 3)  # the prompt's token, then the 2 likeliest
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2]
        assert all(v["decoded_token"] == tokenizer.decode([int(k)]) for k, v in entry.items())


def test_scoring_never_touches_the_kv_cache(server):
    """A score-only request computes no prefill and caches nothing: the next generation of that prompt reuses
    no K/V; the scored tokens are counted apart."""
    seq = [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]
    before = call(server, "request", "GET", "/stats")
    out = request(server, {"prompt": seq, "prompt_logprobs": 0, "max_tokens": 0, "n": 2})
    assert [c["finish_reason"] for c in out["choices"]] == ["length", "length"]
    assert all(c["text"] == "" and len(c["prompt_logprobs"]) == len(seq) for c in out["choices"])
    after = call(server, "request", "GET", "/stats")
    assert after["prefill_tokens"] == before["prefill_tokens"]
    assert after["prompt_logprobs_tokens"] == before["prompt_logprobs_tokens"] + len(seq)
    gen = request(server, {"prompt": seq, "max_tokens": 1})
    assert gen["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_score_only_takes_a_prompt_that_fills_the_context(server):
    """With ``max_tokens: 0`` a prompt of max_model_len tokens is scored; one token longer is a 400 naming it."""
    out = request(server, {"prompt": [3] * 128, "prompt_logprobs": 0, "max_tokens": 0})
    assert len(out["choices"][0]["prompt_logprobs"]) == 128
    with pytest.raises(DeploymentRequestError) as e:
        request(server, {"prompt": [3] * 129, "prompt_logprobs": 0, "max_tokens": 0})
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize(
    "engine_kw",
    [{"decode_kernel": "torch"}, {"use_lean_forward": False}],
    ids=["lean-torch-step", "transformers-fallback"],
)
def test_engine_prompt_logprobs_on_each_forward(tiny_model_path, engine_kw):
    """The lean runner's torch path and the transformers fallback score like a transformers forward (the native
    path is the server's default, tested above); bad input is an ``EngineError`` naming the field."""
    from training.deployment.engine import AsyncEngine
    from training.deployment.engine.requests import EngineError

    async def go():
        engine = AsyncEngine(EngineConfig(model=tiny_model_path, max_batch_size=2, max_model_len=96, **engine_kw))
        await engine.start()
        try:
            scored = await engine.prompt_logprobs(SEQUENCES, top_k=0)
            for bad, field in (
                ([[]], "prompt_token_ids"),
                ([[1] * 97], "prompt_token_ids"),
                ([[10**6]], "prompt_token_ids"),
            ):
                with pytest.raises(EngineError, match=field):
                    await engine.prompt_logprobs(bad)
            with pytest.raises(EngineError, match="prompt_logprobs"):
                await engine.prompt_logprobs([[1, 2]], top_k=21)
            return scored
        finally:
            await engine.shutdown()

    scored = asyncio.run(go())
    for seq, s in zip(SEQUENCES, scored):
        assert s.top_logprobs is None and s.logprobs[0] is None
        if len(seq) > 1:
            got = torch.tensor(s.logprobs[1:], dtype=torch.float64)
            assert (got - hf_logprobs(tiny_model_path, seq)).abs().max().item() <= 1e-4
