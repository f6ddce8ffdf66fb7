"""The distributed weight push into vLLM: ``DistributedWeightSender``'s protocol over ``POST /collective_rpc``.

The trainer is rank 0 of a group it hosts (``weights/distributed.py``: a ``TCPStore`` and a gloo / NCCL
process group of its own, never the default one); every vLLM worker is a member (a server with tensor
parallel K holds K members, counted at connect by ``weight_worker_rank``). What travels and when is the
embedded server's protocol: the metadata goes first (names, wire dtypes, shapes, ``bucket_bytes``,
``update_id``), each member checks it and writes ``accepted`` in the store, the trainer writes ``go`` (or
``abort`` when one refused: nothing moves) and broadcasts the buckets (``weights/buckets.py``). Only the
requests differ; per server (``VLLMDeployment``, blocking, run in a thread):

- join: ``collective_rpc join_weight_group`` (the worker extension, ``vllm_worker.py``);
- update: ``receive_weights`` inside the steps of every vLLM push: wake the weights of a sleeper,
  ``/pause``, ``collective_rpc receive_weights`` (each bucket loaded in place by vLLM's own reload),
  ``/reset_prefix_cache``, ``/update_weight_version``, ``/resume`` (always).

Built by ``DeploymentGroup`` for ``weight_sync="distributed"`` (``Backend.weight_sender``), servers attached by
``base_url`` and started with ``VLLM_SERVER_DEV_MODE=1`` and the worker extension (as for every vLLM push).
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import aiohttp

from training.deployment.weights.distributed import DistributedWeightSender


class VLLMWeightSender(DistributedWeightSender):
    """``DistributedWeightSender`` to vLLM servers (``VLLMDeployment`` objects, launched or attached)."""

    def __init__(self, replicas: Sequence[Any], master_addr: str, **kwargs: Any):
        super().__init__([r.base_url for r in replicas], master_addr, **kwargs)
        self.replicas = list(replicas)

    @classmethod
    def from_replicas(cls, replicas: Sequence[Any], master_addr: str, **kwargs: Any) -> "VLLMWeightSender":
        return cls(replicas, master_addr, **kwargs)

    async def _count_ranks(self, session: aiohttp.ClientSession) -> None:
        self.server_ranks = list(
            await asyncio.gather(*(asyncio.to_thread(r.weight_group_members) for r in self.replicas))
        )

    async def _join_server(self, session: aiohttp.ClientSession, index: int, body: dict) -> dict:
        return await asyncio.to_thread(self.replicas[index].join_weight_group, **body)

    async def _update_server(self, session: aiohttp.ClientSession, index: int, body: dict) -> dict:
        return await asyncio.to_thread(self.replicas[index].receive_weights, body)
