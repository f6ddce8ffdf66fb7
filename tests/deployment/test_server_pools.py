"""``GET /stats`` reports every pool the server keeps with its size and bound, and the sizes stay within
the bounds when more sessions arrive than the KV blocks can keep (real server, tiny model)."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import pytest

from training.deployment.server.kernel_caches import CAPACITY_VARIABLES, KERNEL_CACHE_CAPACITY
from tests.deployment.engine.test_engine import kv_bytes

API_KEY = "pools-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BLOCKS = 8  # KV blocks of 16 tokens: a chat turn here takes one or two
POOLS = (
    "running",
    "waiting",
    "parked_sessions",
    "kv_cache_blocks",
    "rss_bytes",
    "heap_in_use_bytes",
    "heap_free_bytes",
    "open_fds",
    "open_sockets",
)


@pytest.fixture(scope="module")
def server(embedded_server, tiny_model_path):
    return embedded_server(  # fresh: the test counts the sessions and pools it leaves behind
        fresh=True,
        api_key=API_KEY,
        served_model_name="tiny",
        max_model_len=128,
        max_batch_size=2,
        kv_cache_memory_bytes=kv_bytes(tiny_model_path, BLOCKS),
        kv_block_size=16,
        max_waiting=64,
    )


async def _stats(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/stats", headers=AUTH) as r:
        assert r.status == 200
        return await r.json()


async def _chat(s: aiohttp.ClientSession, url: str, session_id: str) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": f"hello {session_id}"}], "max_tokens": 3}
    headers = {**AUTH, "x-multi-turn-session-id": session_id}
    async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()


def test_stats_reports_every_pool_within_its_bound(server, tiny_model_path):
    async def go():
        async with aiohttp.ClientSession() as s:
            before = await _stats(s, server.base_url)
            for i in range(3 * BLOCKS):  # more sessions than blocks: the oldest parked ones are evicted
                await _chat(s, server.base_url, f"pools-{i}")
            return before, await _stats(s, server.base_url)

    before, after = asyncio.run(go())
    for stats in (before, after):
        pools = stats["pools"]
        assert set(POOLS) <= set(pools)
        for name, pool in pools.items():
            assert set(pool) == {"size", "bound"}, name
            if pool["bound"] is not None:
                assert 0 <= pool["size"] <= pool["bound"], (name, pool)
    pools = after["pools"]
    assert pools["parked_sessions"]["bound"] == BLOCKS and pools["kv_cache_blocks"]["bound"] == BLOCKS
    assert 0 < pools["parked_sessions"]["size"] <= BLOCKS  # 24 sessions made, at most 8 kept
    assert pools["running"] == {"size": 0, "bound": 2} and pools["waiting"] == {"size": 0, "bound": 64}
    kv = after["kv_cache"]
    assert kv["blocks_total"] == BLOCKS and kv["blocks_used"] + kv["blocks_cached"] + kv["blocks_free"] == BLOCKS
    assert kv["bytes_total"] == kv_bytes(tiny_model_path, BLOCKS) and kv["block_size"] == 16
    assert pools["rss_bytes"]["size"] > 50 * 2**20  # the server process's (torch and the model loaded), not zero
    assert pools["open_fds"]["size"] >= pools["open_sockets"]["size"] >= 1  # at least the listening socket
    if pools["heap_in_use_bytes"]["size"] is not None:  # glibc: the C heap, torch's tensors included
        assert pools["heap_in_use_bytes"]["size"] > 10 * 2**20 and pools["heap_free_bytes"]["size"] >= 0
    expected = {name: int(os.environ.get(name, KERNEL_CACHE_CAPACITY)) for name in CAPACITY_VARIABLES}
    assert after["kernel_caches"] == expected  # the server bounded oneDNN's shape caches before loading
