"""In-flight weight updates: a push lands between decode steps; every token records the version that produced it.

Checked by replaying greedy decoding with transformers: tokens before the swap are greedy under
the old weights; the rest are greedy under the new weights with the K/V semantics chosen
(``keep``: K/V of the earlier positions stays as the old weights computed it; ``recompute``:
the whole prefix is recomputed under the new weights).
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from tests.deployment.engine.test_engine import PROMPTS, _perturbed, greedy, run_engine

PROMPT = PROMPTS[3]
LENGTH = 120


def _models(path: str, new_tensors: dict[str, torch.Tensor]):
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in new.state_dict().items():
            if name in new_tensors:
                p.copy_(new_tensors[name])
    return old, new


@torch.no_grad()
def _greedy_with_kept_kv(old, new, tokens: list[int], start: int, n: int) -> tuple[list[int], list[float]]:
    """K/V of ``tokens[:start - 1]`` from ``old``; then ``new`` decodes from ``tokens[start - 1]`` for ``n`` tokens."""
    cache = DynamicCache(config=old.config)
    old(torch.tensor([tokens[: start - 1]]), past_key_values=cache, use_cache=True)
    tok, out, lps = tokens[start - 1], [], []
    for i in range(n):
        logits = (
            new(
                torch.tensor([[tok]]),
                past_key_values=cache,
                use_cache=True,
                position_ids=torch.tensor([[start - 1 + i]]),
            )
            .logits[0, -1]
            .float()
        )
        tok = int(logits.argmax())
        out.append(tok)
        lps.append(float(torch.log_softmax(logits, -1)[tok]))
    return out, lps


@torch.no_grad()
def _greedy(model, tokens: list[int], n: int) -> list[int]:
    return model.generate(torch.tensor([tokens]), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)[
        0, len(tokens) :
    ].tolist()


def _run_spanning(path: str, new_tensors, kv_mode: str):
    """One long greedy sequence with an update mid-way, and a request of the same prompt sent after it."""

    async def body(eng):
        task = asyncio.create_task(eng.generate(PROMPT, greedy(LENGTH)))
        while eng.stats()["tokens_generated"] < 30:
            await asyncio.sleep(0.001)
        await eng.pause()  # held mid-sequence however fast the engine is; an in-flight update still lands
        await eng.update_weights(new_tensors, weight_version=1, wait_for_inflight=False)
        running_at_swap = not task.done()
        await eng.resume()
        same_prompt = await eng.generate(PROMPT, greedy(10))
        return await task, same_prompt, running_at_swap

    return run_engine(path, body, inflight_update_kv=kv_mode)


@pytest.mark.parametrize("kv_mode", ["keep", "recompute"])
def test_a_sequence_spanning_an_update_carries_both_versions_labelled_correctly(tiny_model_path, kv_mode):
    new_tensors = _perturbed(tiny_model_path)
    res, same_prompt, running_at_swap = _run_spanning(tiny_model_path, new_tensors, kv_mode)
    assert running_at_swap  # the update did not drain the running sequence
    versions = res.token_weight_versions
    k = versions.index(1)  # first token produced by the new weights
    assert 0 < k < LENGTH and versions == [0] * k + [1] * (LENGTH - k)
    assert res.weight_version == 0  # the oldest version among its tokens

    old, new = _models(tiny_model_path, new_tensors)
    out = res.output_token_ids
    assert _greedy(old, PROMPT, k) == out[:k]
    tokens = PROMPT + out
    kept, kept_lps = _greedy_with_kept_kv(old, new, tokens, len(PROMPT) + k, LENGTH - k)
    recomputed = _greedy(new, tokens[: len(PROMPT) + k], LENGTH - k)
    assert kept != recomputed  # the two semantics differ here, so the check below discriminates
    if kv_mode == "keep":
        assert out[k:] == kept
        assert res.output_logprobs[k:] == pytest.approx(kept_lps, abs=1e-4)
    else:
        assert out[k:] == recomputed

    # a request sent after the update never gets K/V of the old weights from the prefix cache
    assert same_prompt.token_weight_versions == [1] * 10
    assert same_prompt.output_token_ids == _greedy(new, PROMPT, 10)
    if kv_mode == "keep":  # the spanning sequence's prompt K/V is old: not a donor
        assert same_prompt.cached_prompt_tokens == 0
    else:  # recomputed under the new weights: a valid donor
        assert same_prompt.cached_prompt_tokens == len(PROMPT) - 1
