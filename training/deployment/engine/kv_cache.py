"""KV cache: the preallocated slot tensors, and the table of what each slot holds (the prefix cache).

Tensors (``KVCache``): ``k_all`` and ``v_all`` are ``[layers, slots + 1, kv_heads, max_model_len, head_dim]``
in the engine dtype; ``k[layer]`` / ``v[layer]`` are one layer's views. Slot ``num_slots`` (the last) is
scratch: padded rows of a CUDA-graph batch write there, and compaction swaps through it.
``copy(src, dst, n)`` copies positions ``[0, n)`` of one slot into another, every layer at once.

Slot table (``SlotTable``): every slot in ``[0, num_slots)`` is in exactly one state:

- RUNNING: owned by one running sequence. After ``Scheduler.compact`` the running sequences hold
  exactly the slots ``[0, R)``, so a decode step attends over cache rows ``[:R]`` with no gather.
- CACHED: K/V of a finished sequence, reusable by any request whose prompt starts with its tokens.
- PARKED: the same, pinned to a session id (``x-multi-turn-session-id``).
- EMPTY: nothing reusable.

A slot's content is ``token_table[slot, :valid_len]``: those tokens have K/V at positions
``[0, valid_len)``, all computed under the weights of ``version[slot]`` (the scheduler's weight
epoch, bumped by every swap). Only a slot whose version is the live one is ever a donor, so K/V
computed under other weights is never reused. A running slot
counts its prompt as content once prefilled (``valid_len = 0`` while its prefill is pending).
Eviction takes the least valuable non-running slot: EMPTY first, then CACHED least recently used,
then PARKED least recently used (``rank``).
"""

from __future__ import annotations

import enum
import logging
from typing import Iterable, Optional

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

    The whole cache is allocated up front: layers × (slots + 1) × kv_heads × max_model_len ×
    (head_dim + v_head_dim) × element size. A cache that needs more than 90 % of the memory available
    raises ``MemoryError`` naming the two settings that size it, instead of being killed later.
    """

    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_model_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: Optional[int] = None,
    ):
        v_head_dim = v_head_dim or head_dim
        rows = num_layers * (num_slots + 1) * num_kv_heads * max_model_len
        nbytes = rows * (head_dim + v_head_dim) * dtype.itemsize
        available = available_memory_bytes(torch.device(device))
        gib = 1024**3
        if available is not None and nbytes > 0.9 * available:
            raise MemoryError(
                f"KV cache needs {nbytes / gib:.1f} GiB ({num_slots} slots × {max_model_len} tokens × "
                f"{num_layers} layers) but {available / gib:.1f} GiB is available on {device}: lower "
                f"max_batch_size (slots) or max_model_len (deployment.engine_config.max_batch_size / "
                f".max_model_len)"
            )
        logger.info("KV cache: %.2f GiB for %d slots × %d tokens", nbytes / gib, num_slots, max_model_len)
        shape = (num_layers, num_slots + 1, num_kv_heads, max_model_len)
        self.k_all = torch.zeros(shape + (head_dim,), dtype=dtype, device=device)
        self.v_all = torch.zeros(shape + (v_head_dim,), dtype=dtype, device=device)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))
        self.num_slots = num_slots
        self.scratch_slot = num_slots

    @torch.inference_mode()
    def copy(self, src: int, dst: int, n: int) -> None:
        """K/V of positions ``[0, n)`` of slot ``src`` into slot ``dst`` (all layers)."""
        if n > 0 and src != dst:
            self.k_all[:, dst, :, :n].copy_(self.k_all[:, src, :, :n])
            self.v_all[:, dst, :, :n].copy_(self.v_all[:, src, :, :n])


class SlotState(enum.IntEnum):
    """What a slot holds; the value orders eviction (lowest goes first; RUNNING is never evicted)."""

    EMPTY = 0
    CACHED = 1
    PARKED = 2
    RUNNING = 3


class SlotTable:
    """State, content tokens, weight version and recency of every KV slot; prefix lookup over all of them."""

    def __init__(self, num_slots: int, max_model_len: int):
        self.num_slots = num_slots
        self.max_model_len = max_model_len
        self.state = [SlotState.EMPTY] * num_slots
        self.token_table = torch.full((num_slots, max_model_len), -1, dtype=torch.int32)
        """Row s: the tokens of slot s's content (only ``[:valid_len[s]]`` is meaningful)."""
        self.valid_len = [0] * num_slots
        self.version = [0] * num_slots
        self.session: list[Optional[str]] = [None] * num_slots
        self.parked: dict[str, int] = {}
        """Session id → its PARKED slot."""
        self._stamp = [0] * num_slots
        self._clock = 0

    # ----------------------------------------------------------------- queries
    def count(self, state: SlotState) -> int:
        return sum(1 for s in self.state if s == state)

    def rank(self, slot: int) -> tuple[int, int]:
        """Eviction order of a non-running slot: lower goes first."""
        return int(self.state[slot]), self._stamp[slot]

    def victim(self, candidates: Iterable[int]) -> Optional[int]:
        """The least valuable non-running slot among ``candidates`` (None if there is none)."""
        pool = [s for s in candidates if self.state[s] != SlotState.RUNNING]
        return min(pool, key=self.rank) if pool else None

    def prefix_lengths(self, prompt: list[int], version: int) -> torch.Tensor:
        """Per slot: how many leading prompt tokens it holds valid K/V for under ``version`` ([num_slots] int64).

        One vectorised comparison of the prompt against every slot's token row (no hashing, so
        no collisions): the first mismatch, capped at the slot's ``valid_len``, 0 for unusable slots.
        """
        m = min(len(prompt), self.max_model_len)
        eq = self.token_table[:, :m] == torch.tensor(prompt[:m], dtype=torch.int32)
        lcp = torch.where(eq.all(1), m, (~eq).to(torch.int8).argmax(1))
        usable = [self.state[s] != SlotState.EMPTY and self.version[s] == version for s in range(self.num_slots)]
        limit = torch.tensor([v if ok else 0 for v, ok in zip(self.valid_len, usable)])
        return torch.minimum(lcp, limit)

    # ----------------------------------------------------------------- changes
    def touch(self, slot: int) -> None:
        """Mark ``slot`` most recently used."""
        self._clock += 1
        self._stamp[slot] = self._clock

    def write(
        self,
        slot: int,
        state: SlotState,
        tokens: list[int],
        valid_len: int,
        version: int,
        session: Optional[str] = None,
    ) -> None:
        """Set a slot's state and content (``tokens[:valid_len]`` have K/V under ``version``)."""
        self._unpark(slot)
        n = min(len(tokens), self.max_model_len)
        self.token_table[slot, :n] = torch.tensor(tokens[:n], dtype=torch.int32)
        self.state[slot] = state
        self.valid_len[slot] = min(valid_len, n)
        self.version[slot] = version
        if state == SlotState.PARKED:
            old = self.parked.get(session)
            if old is not None and old != slot:  # the session's previous turn stays, as anonymous cache
                self.state[old], self.session[old] = SlotState.CACHED, None
            self.parked[session] = slot
            self.session[slot] = session
        self.touch(slot)

    def clear(self, slot: int) -> None:
        """Forget a slot's content."""
        self._unpark(slot)
        self.state[slot] = SlotState.EMPTY
        self.valid_len[slot] = 0

    def move(self, src: int, dst: int) -> None:
        """Move ``src``'s description to ``dst`` (the caller moved the K/V); ``src`` becomes EMPTY."""
        session = self.session[src]
        self._unpark(src)
        self._unpark(dst)
        n = self.valid_len[src]
        self.token_table[dst, :n] = self.token_table[src, :n]
        self.state[dst], self.valid_len[dst], self.version[dst] = self.state[src], n, self.version[src]
        self._stamp[dst] = self._stamp[src]
        if session is not None:
            self.session[dst] = session
            self.parked[session] = dst
        self.clear(src)

    def swap(self, a: int, b: int) -> None:
        """Exchange the descriptions of two slots (the caller swapped the K/V)."""
        row = self.token_table[a].clone()
        self.token_table[a] = self.token_table[b]
        self.token_table[b] = row
        for attr in ("state", "valid_len", "version", "session", "_stamp"):
            values = getattr(self, attr)
            values[a], values[b] = values[b], values[a]
        for s in (a, b):
            if self.session[s] is not None:
                self.parked[self.session[s]] = s

    def unpark(self, slot: int) -> None:
        """A PARKED slot becomes anonymous cache (its session moved on)."""
        if self.state[slot] == SlotState.PARKED:
            self._unpark(slot)
            self.state[slot] = SlotState.CACHED

    def drop_reusable(self) -> int:
        """Every CACHED / PARKED slot becomes EMPTY (after a weight update); returns how many sessions were parked."""
        n = len(self.parked)
        for s in range(self.num_slots):
            if self.state[s] in (SlotState.CACHED, SlotState.PARKED):
                self.clear(s)
        return n

    def _unpark(self, slot: int) -> None:
        session = self.session[slot]
        if session is not None:
            if self.parked.get(session) == slot:
                del self.parked[session]
            self.session[slot] = None
