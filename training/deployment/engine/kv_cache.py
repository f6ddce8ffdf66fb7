"""KV cache slots: the preallocated tensors and the table of which slot holds what.

Layout: ``k[layer]`` and ``v[layer]`` are ``[slots + 1, kv_heads, max_model_len, head_dim]`` in
the engine dtype. Slot ``num_slots`` (the last) is scratch: padded rows of a CUDA-graph batch
write there, so no real sequence's K/V is touched.

Slot states (``SlotTable``): free, running (owned by one sequence), or parked (a finished
session's tokens kept for the next turn). Invariants: every slot index in ``[0, num_slots)`` is in
exactly one of ``free`` / ``running`` / ``parked``; parked slots are evicted least-recently-used
when a running sequence needs a slot; ``drop_parked()`` frees them all (after a weight update).
"""

from __future__ import annotations

import heapq
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def available_memory_bytes(device: torch.device) -> Optional[int]:
    """Free memory the cache could use: CUDA's free bytes, or MemAvailable on Linux; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class KVCache:
    """Per-layer K and V tensors for every slot (plus one scratch slot).

    The whole cache is allocated up front: 2 × layers × (slots + 1) × kv_heads × max_model_len ×
    head_dim × element size. A cache that needs more than 90 % of the memory available raises
    ``MemoryError`` naming the two settings that size it, instead of being killed later.
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_model_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device):
        shape = (num_slots + 1, num_kv_heads, max_model_len, head_dim)
        nbytes = 2 * num_layers * (num_slots + 1) * num_kv_heads * max_model_len * head_dim * dtype.itemsize
        available = available_memory_bytes(torch.device(device))
        gib = 1024 ** 3
        if available is not None and nbytes > 0.9 * available:
            raise MemoryError(f"KV cache needs {nbytes / gib:.1f} GiB ({num_slots} slots × {max_model_len} tokens × "
                              f"{num_layers} layers) but {available / gib:.1f} GiB is available on {device}: lower "
                              f"max_batch_size (slots) or max_model_len (deployment.engine_config.max_batch_size / "
                              f".max_model_len)")
        logger.info("KV cache: %.2f GiB for %d slots × %d tokens", nbytes / gib, num_slots, max_model_len)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.scratch_slot = num_slots


@dataclass
class ParkedSession:
    """A finished session's slot: ``token_ids[:kv_len]`` have valid K/V in ``slot``."""

    slot: int
    token_ids: list[int]
    kv_len: int


class SlotTable:
    """Allocation of KV slots to running sequences and parked sessions (lowest free slot first)."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots))
        heapq.heapify(self._free)
        self.parked: OrderedDict[str, ParkedSession] = OrderedDict()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        """A slot is free or can be had by evicting a parked session."""
        return bool(self._free) or bool(self.parked)

    def allocate(self) -> int:
        """Take the lowest free slot, evicting the least-recently-used parked session if none is free."""
        if not self._free:
            if not self.parked:
                raise RuntimeError("no KV slot free and none parked")
            _, old = self.parked.popitem(last=False)
            heapq.heappush(self._free, old.slot)
        return heapq.heappop(self._free)

    def free(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def park(self, session_id: str, slot: int, token_ids: list[int], kv_len: int) -> None:
        """Keep ``slot`` for ``session_id`` (replacing, and freeing, an older parked slot of it)."""
        old = self.parked.pop(session_id, None)
        if old is not None:
            self.free(old.slot)
        self.parked[session_id] = ParkedSession(slot, list(token_ids), kv_len)

    def take_parked(self, session_id: str) -> ParkedSession | None:
        """Remove and return the session's parked slot (the caller now owns the slot)."""
        return self.parked.pop(session_id, None)

    def drop_parked(self) -> int:
        """Free every parked slot (their K/V is stale); returns how many were dropped."""
        n = len(self.parked)
        for p in self.parked.values():
            self.free(p.slot)
        self.parked.clear()
        return n


def common_prefix_len(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
