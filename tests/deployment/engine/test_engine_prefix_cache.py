"""Automatic prefix caching: reuse across requests without a session id, exactness, versions, LRU eviction."""

from __future__ import annotations

import asyncio
import random

import pytest

from training.deployment.engine import SamplingParams
from training.deployment.engine.weights import load_safetensors
from tests.deployment.engine.test_engine import greedy, kv_bytes, require_native, run_engine

PROMPT = [7, 300, 12, 45, 99, 101, 5, 6, 250, 251, 252, 40, 41, 42, 43, 8, 9, 10, 11, 13, 14, 15, 16, 17]


def sampled(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, ignore_eos=True)


def cold(path: str, requests: list[tuple[list[int], SamplingParams]], **kw):
    """Each request alone, prefix caching off: the reference every cached run must reproduce."""

    async def body(eng):
        return [await eng.generate(p, sp) for p, sp in requests]

    return run_engine(path, body, enable_prefix_caching=False, **kw)


def assert_same_outputs(warm, ref, atol=1e-5):
    for w, r in zip(warm, ref):
        assert w.output_token_ids == r.output_token_ids
        assert w.output_logprobs == pytest.approx(r.output_logprobs, abs=atol)


def test_group_of_8_identical_prompts_computes_the_prompt_about_once(tiny_model_path):
    requests = [(PROMPT, sampled(seed=100 + i)) for i in range(4)] + [(PROMPT, greedy(16)) for _ in range(4)]

    async def body(eng):
        results = await asyncio.gather(*[eng.generate(p, sp) for p, sp in requests])
        return results, eng.stats()

    results, stats = run_engine(tiny_model_path, body, max_batch_size=8)
    p = len(PROMPT)
    assert stats["prefill_tokens"] <= p + 7  # the leader's prompt, at most one token per other member
    assert stats["cached_prompt_tokens"] >= 7 * (p - 1)
    assert sum(r.cached_prompt_tokens for r in results) == stats["cached_prompt_tokens"]
    assert sorted(r.cached_prompt_tokens for r in results)[0] == 0  # exactly the leader computed it
    assert_same_outputs(results, cold(tiny_model_path, requests))
    assert len({tuple(r.output_token_ids) for r in results[:4]}) == 4  # different seeds, different samples


def test_same_step_followers_share_the_leaders_logits_and_kv(tiny_model_path):
    """Requests queued before the engine's first step arrive together: followers prefill nothing."""
    requests = [(PROMPT, sampled(seed=i, max_tokens=12)) for i in range(8)]

    async def body(eng):
        await eng.pause()
        tasks = [asyncio.ensure_future(eng.generate(p, sp)) for p, sp in requests]
        await asyncio.sleep(0.05)
        await eng.resume()
        return await asyncio.gather(*tasks), eng.stats()

    results, stats = run_engine(tiny_model_path, body, max_batch_size=8)
    assert stats["prefill_tokens"] == len(PROMPT)
    assert sorted(r.cached_prompt_tokens for r in results) == [0] + [len(PROMPT)] * 7
    assert_same_outputs(results, cold(tiny_model_path, requests))


def test_next_turn_without_session_id_reuses_the_previous_turn(tiny_model_path):
    async def body(eng):
        first = await eng.generate(PROMPT, greedy(10))
        turn2 = PROMPT + first.output_token_ids + [31, 32, 33]
        second = await eng.generate(turn2, greedy(10))
        other = await eng.generate(PROMPT[:10] + [400, 401, 402], greedy(10))  # shares 10 tokens
        return first, turn2, second, other

    first, turn2, second, other = run_engine(tiny_model_path, body)
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == len(PROMPT) + 10 - 1  # all tokens with K/V: the last sampled has none
    assert other.cached_prompt_tokens == 10
    ref = cold(tiny_model_path, [(turn2, greedy(10)), (PROMPT[:10] + [400, 401, 402], greedy(10))])
    assert_same_outputs([second, other], ref)


def test_cache_off_reuses_nothing_but_sessions(tiny_model_path):
    async def body(eng):
        await eng.generate(PROMPT, greedy(6))
        again = await eng.generate(PROMPT, greedy(6))
        first = await eng.generate(PROMPT, greedy(6), session_id="s")
        turn2 = await eng.generate(PROMPT + first.output_token_ids + [3], greedy(6), session_id="s")
        return again, turn2, eng.stats()

    again, turn2, stats = run_engine(tiny_model_path, body, enable_prefix_caching=False, kv_block_size=16)
    assert again.cached_prompt_tokens == 0
    assert turn2.cached_prompt_tokens == len(PROMPT) + 6 - 1
    held = len(turn2.prompt_token_ids) + len(turn2.output_token_ids) - 1  # positions with K/V: the parked turn's
    assert stats["kv_cache"]["blocks_cached"] == -(-held // 16)  # nothing but the session's parked turn is kept


def test_no_reuse_across_a_weight_update_even_with_the_same_weights(tiny_model_path):
    async def body(eng):
        before = await eng.generate(PROMPT, greedy(8))
        warm = await eng.generate(PROMPT + [3], greedy(8))
        await eng.update_weights(load_safetensors(tiny_model_path), weight_version=0)  # same version, same weights
        after = await eng.generate(PROMPT + [3], greedy(8))
        return before, warm, after, eng.stats()

    before, warm, after, stats = run_engine(tiny_model_path, body, kv_block_size=16)
    assert warm.cached_prompt_tokens == len(PROMPT)
    held = len(PROMPT) + 1 + 8 - 1
    assert after.cached_prompt_tokens == 0 and stats["kv_cache"]["blocks_cached"] == -(-held // 16)  # only after's
    assert after.output_token_ids == warm.output_token_ids


def test_lru_eviction_under_a_four_block_budget(tiny_model_path):
    """Each request holds 2 blocks of 16 tokens; a pool of 4 keeps two finished requests' prefixes."""
    a, b, c = PROMPT, [200 + i for i in range(20)], [100 + i for i in range(20)]

    async def body(eng):
        for p in (a, b):
            await eng.generate(p, greedy(4))  # the pool: a's 2 blocks and b's 2, all cached
        a2 = await eng.generate(a + [1], greedy(4))  # hit on a: a is now the most recently used
        await eng.generate(c, greedy(4))  # needs 2 blocks: evicts b's (least recent), keeps a's
        a3 = await eng.generate(a + [2], greedy(4))
        b2 = await eng.generate(b + [3], greedy(4))
        return a2, a3, b2

    budget = kv_bytes(tiny_model_path, 4)
    a2, a3, b2 = run_engine(tiny_model_path, body, max_batch_size=1, kv_cache_memory_bytes=budget, kv_block_size=16)
    assert a2.cached_prompt_tokens == len(a)
    assert a3.cached_prompt_tokens == len(a)
    assert b2.cached_prompt_tokens == 0


def test_the_pool_holds_more_cached_prefixes_than_the_running_batch(tiny_model_path):
    prompts = [[50 + 7 * i + j for j in range(12)] for i in range(4)]

    async def body(eng):
        for p in prompts:
            await eng.generate(p, greedy(3))
        again = [await eng.generate(p + [9], greedy(3)) for p in prompts]
        return again, eng.stats()

    budget = kv_bytes(tiny_model_path, 8)
    again, stats = run_engine(tiny_model_path, body, max_batch_size=2, kv_cache_memory_bytes=budget, kv_block_size=16)
    assert [r.cached_prompt_tokens for r in again] == [len(p) for p in prompts]
    assert stats["kv_cache"]["blocks_used"] == 0 and stats["kv_cache"]["blocks_cached"] == 8


def test_random_traffic_with_shared_prefixes_matches_cold_runs(tiny_model_path):
    """Shared and copied blocks, evictions, preemptions and followers under churn never change an output."""
    rng = random.Random(0)
    stems = [[rng.randrange(3, 500) for _ in range(rng.randint(4, 30))] for _ in range(4)]
    requests = []
    for i in range(40):
        stem = stems[rng.randrange(len(stems))]
        prompt = stem[: rng.randint(1, len(stem))] + [rng.randrange(3, 500) for _ in range(rng.randint(0, 6))]
        requests.append((prompt, greedy(rng.randint(1, 20)) if i % 2 else sampled(i, rng.randint(1, 20))))

    async def body(eng):
        out = []
        for chunk in range(0, len(requests), 10):  # bursts of 10 over 3 running slots
            out += await asyncio.gather(*[eng.generate(p, sp) for p, sp in requests[chunk : chunk + 10]])
        return out, eng.stats()

    budget = kv_bytes(tiny_model_path, 14)  # 3 running requests of up to 4 blocks each, and a little cache
    results, stats = run_engine(tiny_model_path, body, max_batch_size=3, kv_cache_memory_bytes=budget, kv_block_size=16)
    assert stats["cached_prompt_tokens"] > 0 and stats["pools"]["kv_cache_blocks"]["size"] <= 14
    assert stats["prefill_tokens"] + stats["cached_prompt_tokens"] == sum(len(p) for p, _ in requests)
    assert_same_outputs(results, cold(tiny_model_path, requests))


# ---- shared-prefix decode attention ------------------------------------------------------------


@pytest.mark.parametrize("every_row_grouped, dtype", [(False, "float32"), (True, "float32"), (False, "bfloat16")])
def test_shared_prefix_attention_equals_attention_over_whole_rows(every_row_grouped, dtype):
    """Groups sharing their prefix blocks (the partial last one copied) and rows of their own (or none), each row's
    blocks scattered over the pool: the same output as plain SDPA over the rows' gathered blocks (in bf16: as
    fp32 SDPA on the same bf16 values, to bf16's rounding)."""
    import torch
    import torch.nn.functional as F

    from training.deployment.engine.kv_cache import gather_blocks
    from training.deployment.engine.runners.lean import SharedPrefix, SharedPrefixAttention

    torch.manual_seed(0)
    b, kh, g, d, bs, width = 7, 2, 3, 16, 16, 6
    pool = b * width + 1
    k_cache, v_cache = torch.randn(pool, kh, bs, d), torch.randn(pool, kh, bs, d)
    order = torch.randperm(pool - 1).tolist()
    tables = [order[r * width : (r + 1) * width] for r in range(b)]
    groups = [SharedPrefix([0, 1, 2], 60), SharedPrefix([3, 5], 40)]
    positions = [62, 65, 70, 41, 10, 44, 12]  # row 4 and row 6: in no group
    if every_row_grouped:
        groups = [SharedPrefix([0, 1, 2], 60), SharedPrefix([3, 4], 40), SharedPrefix([5, 6], 90)]
        positions = [62, 65, 70, 41, 52, 95, 91]  # suffixes of 1 to 12 keys; the last row's ends at its last block
    for grp in groups:
        full, part = divmod(grp.length, bs)
        lead = tables[grp.rows[0]]
        for r in grp.rows[1:]:
            tables[r][:full] = lead[:full]  # the full blocks shared
            k_cache[tables[r][full], :, :part] = k_cache[lead[full], :, :part]  # the partial one copied
            v_cache[tables[r][full], :, :part] = v_cache[lead[full], :, :part]
    dt = getattr(torch, dtype)
    k_cache, v_cache = k_cache.to(dt), v_cache.to(dt)
    plan = SharedPrefixAttention.plan(positions, groups, tables, bs, kh, dt)
    assert plan is not None and (plan.grouped_rows is None) == every_row_grouped
    q = torch.randn(b, kh, g, d).to(dt)
    key_len = width * bs
    visible = torch.arange(key_len)[None, :] <= torch.tensor(positions)[:, None]
    mask = torch.zeros(b, key_len).masked_fill_(~visible, float("-inf"))[:, None, None, :]
    keys, values = (gather_blocks(c, torch.tensor(tables)).float() for c in (k_cache, v_cache))
    want = F.scaled_dot_product_attention(q.float(), keys, values, attn_mask=mask)
    got = plan.attend(q, k_cache, v_cache)
    assert got.dtype == dt and torch.allclose(got.float(), want, atol=1e-6 if dtype == "float32" else 2e-2)
    # not worth it: short prefixes against long rows of their own
    assert SharedPrefixAttention.plan(positions, [SharedPrefix([0, 1], 4)], tables, bs, kh) is None


@pytest.mark.parametrize("decode_kernel", ["torch", "native"])
def test_group_members_decode_over_one_copy_of_the_prompt_and_match_cold(tiny_model_path, monkeypatch, decode_kernel):
    """A GRPO group with a long prompt: its members hold the prompt's full blocks once (shared: reference-counted)
    and decode reads them once for all members; outputs as cold.

    torch: the step takes ``SharedPrefixAttention``; native: the C step gets one attention segment
    holding every member, over a shared prefix.
    """
    import training.deployment.engine.runners.native as native_module
    from training.deployment.engine.runners.lean import SharedPrefixAttention
    from training.deployment.engine.scheduler import Scheduler

    if decode_kernel == "native":
        require_native()
    rng = random.Random(3)
    prompt = [rng.randrange(3, 500) for _ in range(150)]
    requests = [(prompt, sampled(seed=10, max_tokens=40))]
    requests += [(prompt, sampled(seed=11 + i, max_tokens=10)) for i in range(3)] + [(prompt, greedy(10))] * 2
    largest, used, refs = [0], [0], []
    plan, batch, segments = SharedPrefixAttention.plan, Scheduler.decode_batch, native_module.segments

    def spy_batch(self):
        order, groups = batch(self)
        largest[0] = max([largest[0], *(len(g.rows) for g in groups)])
        if len(order) == len(requests):  # every member running: how often each holds the prompt's first block
            refs.append(self.blocks.ref[order[0].block_table[0]])
        return order, groups

    def spy_plan(*args):
        made = plan(*args)
        used[0] += made is not None
        return made

    def spy_segments(positions, shared):
        starts, rows, prefixes = segments(positions, shared)
        sizes = [b - a for a, b, p in zip(starts, starts[1:], prefixes) if p > 0]
        used[0] += max(sizes, default=0) == len(requests)
        return starts, rows, prefixes

    monkeypatch.setattr(Scheduler, "decode_batch", spy_batch)
    monkeypatch.setattr(SharedPrefixAttention, "plan", staticmethod(spy_plan))
    monkeypatch.setattr(native_module, "segments", spy_segments)

    async def body(eng):
        stream = eng.generate_stream(*requests[0])
        await stream.__anext__()  # the leader decodes: later members share its prompt blocks from its running table
        await eng.pause()  # held mid-sequence however loaded the machine, so every member joins it
        members = asyncio.gather(*[eng.generate(p, sp) for p, sp in requests[1:]])
        while eng.stats()["waiting"] < len(requests) - 1:
            await asyncio.sleep(0.005)
        await eng.resume()
        rest = await members
        async for delta in stream:
            if delta.result is not None:
                return [delta.result, *rest]

    results = run_engine(tiny_model_path, body, max_batch_size=8, decode_kernel=decode_kernel, kv_block_size=16)
    assert largest[0] == len(requests)  # followers and later members share the leader's blocks
    assert refs and max(refs) == len(requests)  # the prompt's blocks are stored once, held by every member
    assert used[0] > 0
    monkeypatch.undo()
    assert_same_outputs(results, cold(tiny_model_path, requests, decode_kernel=decode_kernel))
