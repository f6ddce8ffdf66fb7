"""Prefix-cache exactness under eviction: a request's output never depends on what else the cache holds.

A block an admission shares or copies from is never that admission's eviction victim, and K/V
computed under other weights is never reused (tested below against cold engines, also with in-flight
weight updates between requests, over a pool small enough that blocks are evicted and sequences
preempted).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Optional, Union

import pytest
import torch

from training.deployment.engine import EngineConfig, GenerationResult, SamplingParams
from training.deployment.engine.engine import LLMEngine, PendingUpdate
from training.deployment.engine.weights import load_safetensors, validate_update
from tests.deployment.engine.test_engine import greedy, kv_bytes, run_engine
from tests.deployment.engine.test_engine_prefix_cache import assert_same_outputs, cold, sampled


def test_oldest_parked_session_is_never_evicted_while_it_donates_the_prefix(tiny_model_path):
    """8 blocks, all held by 4 parked sessions (2 each); a seeded request shares a prefix with the oldest one.

    That session is both the best donor and the least recently parked (what eviction takes first): its
    block must be held before anything is evicted, so the output equals a cold run's.
    """
    rng = random.Random(5)
    sessions = [[rng.randrange(3, 500) for _ in range(20)] for _ in range(4)]
    canary = (sessions[0][:16] + [rng.randrange(3, 500) for _ in range(4)], sampled(seed=11, max_tokens=12))
    canary_greedy = (sessions[0][:12] + [rng.randrange(3, 500) for _ in range(3)], greedy(12))

    async def body(eng):
        for i, prompt in enumerate(sessions):  # as behind the recording proxy: every finished turn parked
            await eng.generate(prompt, greedy(6), session_id=f"s{i}")
        first = await eng.generate(*canary)
        for i, prompt in enumerate(sessions):  # park them all again, the oldest again first
            await eng.generate(prompt, greedy(6), session_id=f"t{i}")
        second = await eng.generate(*canary_greedy)
        return [first, second], eng.stats()

    budget = kv_bytes(tiny_model_path, 8)
    results, stats = run_engine(tiny_model_path, body, max_batch_size=4, kv_cache_memory_bytes=budget, kv_block_size=16)
    assert results[0].cached_prompt_tokens == 16  # the oldest parked slot did donate
    assert results[1].cached_prompt_tokens == 12
    assert_same_outputs(results, cold(tiny_model_path, [canary, canary_greedy]))


# ---- property: random interleavings against cold engines -----------------------------------------

CHECKED = "checked"
POOL_BLOCKS = 24
POOL = {"kv_block_size": 16}
"""Engine settings of the random traces (``kv_cache_memory_bytes`` added by ``random_traffic``: ``POOL_BLOCKS``)."""


@dataclass
class Traffic:
    """What a random trace did: every request's result (or failure), and the weights of each version."""

    results: list[Union[GenerationResult, BaseException, None]] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    stats: dict = field(default_factory=dict)


def _weight_sets(path: str, count: int) -> list[dict[str, torch.Tensor]]:
    """The checkpoint, then ``count - 1`` perturbed copies of it (each different: stale K/V would show)."""
    base = load_safetensors(path)
    sets = [base]
    for k in range(1, count):
        g = torch.Generator().manual_seed(100 + k)
        sets.append({n: t + 0.3 * torch.randn(t.shape, generator=g) for n, t in base.items()})
    return sets


def _push(engine: LLMEngine, tensors: dict[str, torch.Tensor], version: int, wait: bool, done) -> None:
    """Queue an update on an engine stepped on this thread (what ``AsyncEngine.update_weights`` queues)."""
    checked = validate_update(tensors, engine.runner.weight_shapes, engine.runner.tied)
    engine.pending_updates.append(PendingUpdate(checked, version, wait, done))


def random_traffic(path: str, seed: int, num_requests: int, updates: int = 0, **config) -> Traffic:
    """Step one engine on this thread through a seeded random mix of requests (and weight updates).

    Each tick adds 0-3 requests, sometimes queues a weight update (applied at the next step, in
    flight unless it waits), then runs one step. Requests: sessionless prompts from a few shared
    stems (some identical in one tick: followers), session turns that extend the session's
    previous turn (as a multi-turn agent behind the proxy: every finished turn parked), fresh
    sessions on shared stems (so parked slots of other sessions donate prefixes); greedy, seeded
    or unseeded sampling (the unseeded ones are traffic only).
    """
    rng = random.Random(seed)
    stems = [[rng.randrange(3, 500) for _ in range(rng.randint(8, 30))] for _ in range(4)]
    weight_sets = _weight_sets(path, 3) if updates else []
    config.setdefault("kv_cache_memory_bytes", kv_bytes(path, POOL_BLOCKS))
    engine = LLMEngine(EngineConfig(model=path, max_model_len=256, **config))
    out = Traffic(weights={0: weight_sets[0]} if updates else {})
    last_turn: dict[str, Optional[GenerationResult]] = {}  # session → its finished turn (None: running)

    def stem_prompt() -> list[int]:
        stem = stems[rng.randrange(len(stems))]
        return stem[: rng.randint(1, len(stem))] + [rng.randrange(3, 500) for _ in range(rng.randint(0, 6))]

    def params() -> SamplingParams:
        kind, n = rng.random(), rng.randint(1, 12)
        if kind < 0.4:
            return greedy(n)
        return sampled(seed=rng.randrange(1 << 30), max_tokens=n) if kind < 0.85 else sampled(seed=None, max_tokens=n)

    def add(prompt: list[int], sp: SamplingParams, session: Optional[str]) -> None:
        i = len(out.results)
        out.results.append(None)
        out.params.append(sp)

        def done(res):
            out.results[i] = res
            if session is not None:
                last_turn[session] = res if isinstance(res, GenerationResult) else None

        if session is not None:
            last_turn[session] = None
        engine.add(engine.make_sequence(prompt, sp, session, done))

    issued, version, pushed = 0, 0, 0
    while issued < num_requests or engine.has_work():
        for _ in range(rng.choice((0, 0, 1, 1, 2, 3)) if issued < num_requests else 0):
            roll = rng.random()
            idle = [s for s, r in last_turn.items() if r is not None and len(r.prompt_token_ids) < 150]
            if roll < 0.35 and idle:  # the next turn of a session
                s = rng.choice(idle)
                prev = last_turn[s]
                add(prev.prompt_token_ids + prev.output_token_ids + stem_prompt()[:4], params(), s)
            elif roll < 0.55:  # a new session on a shared stem
                add(stem_prompt(), params(), f"s{issued}")
            elif roll < 0.7:  # identical prompts in one tick (a group, n > 1)
                prompt = stem_prompt()
                for _ in range(rng.randint(2, 3)):
                    add(prompt, params(), None)
            else:
                add(stem_prompt(), params(), None)
            issued += 1
        if pushed < updates and issued and rng.random() < 0.08:
            version, pushed = version + 1, pushed + 1
            out.weights[version] = weight_sets[version % len(weight_sets)]
            _push(engine, out.weights[version], version, rng.random() < 0.3, lambda exc: None)
        if engine.has_work():
            engine.step()
    out.stats = {**engine.stats(), "evictions": engine.scheduler.blocks.evicted}
    return out


def cold_reference(path: str, traffic: Traffic, indices: list[int], version: Optional[int] = None) -> list:
    """Each request alone on a fresh engine with prefix caching off (holding ``version``'s weights)."""
    engine = LLMEngine(EngineConfig(model=path, max_model_len=256, max_batch_size=1, enable_prefix_caching=False))
    if version is not None:
        _push(engine, traffic.weights[version], version, False, lambda exc: None)
    outs = []
    for i in indices:
        res = traffic.results[i]
        engine.add(engine.make_sequence(res.prompt_token_ids, traffic.params[i], None, outs.append))
        while engine.has_work():
            engine.step()
    return outs


def assert_every_deterministic_request_matches_cold(path: str, traffic: Traffic) -> int:
    """Greedy and seeded requests whose tokens all came from one weight version: as on a cold engine."""
    by_version: dict[Optional[int], list[int]] = {}
    for i, res in enumerate(traffic.results):
        assert isinstance(res, GenerationResult), f"request {i} did not finish: {res!r}"
        if traffic.params[i].temperature > 0 and traffic.params[i].seed is None:
            continue
        versions = set(res.token_weight_versions)
        if len(versions) == 1:  # a request that straddled an in-flight update has no cold twin
            by_version.setdefault(versions.pop() if traffic.weights else None, []).append(i)
    for version, indices in by_version.items():
        ref = cold_reference(path, traffic, indices, version)
        assert_same_outputs([traffic.results[i] for i in indices], ref)
    return sum(len(v) for v in by_version.values())


@pytest.mark.parametrize(
    "seed, num_requests, running, blocks",
    [
        (0, 40, 3, POOL_BLOCKS),
        (1, 40, 8, 12),
        pytest.param(1, 40, 3, POOL_BLOCKS, marks=pytest.mark.slow),
        pytest.param(3, 120, 3, POOL_BLOCKS, marks=pytest.mark.slow),
        pytest.param(3, 120, 8, 12, marks=pytest.mark.slow),
    ],
)
def test_random_sessions_and_evictions_never_change_an_output(tiny_model_path, seed, num_requests, running, blocks):
    """Sessions and sessionless requests interleaved over a small pool of blocks of 16 tokens (24 blocks for 3
    running sequences of up to 11 blocks each; or 12 blocks for 8, where running sequences are preempted):
    every output as on a cold engine."""
    budget = kv_bytes(tiny_model_path, blocks)
    traffic = random_traffic(
        tiny_model_path,
        seed,
        num_requests,
        max_batch_size=running,
        max_prefill_tokens=64,
        kv_cache_memory_bytes=budget,
        **POOL,
    )
    assert traffic.stats["cached_prompt_tokens"] > 0 and traffic.stats["evictions"] > 0  # the cache was used, churned
    if running == 8:
        assert traffic.stats["preemptions"] > 0
    assert assert_every_deterministic_request_matches_cold(tiny_model_path, traffic) >= num_requests // 2


@pytest.mark.parametrize("kv, seed", [("keep", 2), ("recompute", 2), pytest.param("keep", 4, marks=pytest.mark.slow)])
def test_kv_of_other_weights_is_never_reused_across_inflight_updates(tiny_model_path, kv, seed):
    """The same traffic with weight updates between steps: every request that ran on one version
    equals a cold engine holding that version's weights (no K/V computed under other weights reused)."""
    traffic = random_traffic(tiny_model_path, seed, 40, updates=4, max_batch_size=3, inflight_update_kv=kv, **POOL)
    assert len(traffic.weights) == 5 and traffic.stats["cached_prompt_tokens"] > 0
    assert assert_every_deterministic_request_matches_cold(tiny_model_path, traffic) >= 15
