"""KV cache: one pool of fixed-size blocks (``KVCache``), sized by a memory budget (``KVBudget``).

Tensors: ``k_all`` and ``v_all`` are ``[layers, num_blocks + 1, kv_heads, block_size, head_dim]`` in the
engine dtype; ``k[layer]`` / ``v[layer]`` are one layer's views. Position ``p`` of a sequence lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat *KV slot* is
``block * block_size + offset`` (vLLM's slot mapping). Inside a block the keys of one kv head are one
contiguous run of ``block_size x head_dim`` values, which the C decode step streams as it is.

Block ``num_blocks`` (the last, ``null_block``) belongs to no sequence: padded rows of a CUDA-graph batch
write there and block tables are padded with it. Its values stay finite (zeroed at creation and wake;
only padding rows write it), and it is always masked out of attention.

Which block holds what, who shares it and what is evicted is the block manager's (``block_manager.py``).
A block is zeroed when it is handed out (``hand_out``): attention reads whole blocks and masks the
positions past a row's length, so they must hold finite values, never leftover bits of freed memory.
The C decode step (native.py) reads only the positions a row has written, so its runner turns that off
(``zero_handed_out``): zeroing a reused block wrote ~3 % of a decode-heavy run's time for nothing.
On CPU the pool is allocated untouched (``torch.empty``): its pages become resident as blocks are first
handed out, so the process holds the blocks used so far, not the budget (``resident_bytes``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from dataclasses import dataclass
from typing import Optional

import torch

logger = logging.getLogger(__name__)

GIB = 1024**3


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


UNKNOWN_MEMORY_BUDGET = GIB
"""Pool bytes sized by ``kv_cache_memory_fraction`` where the free memory cannot be read (no /proc)."""


@dataclass(frozen=True)
class KVBudget:
    """How many blocks the pool gets: ``num_blocks`` as given, else ``memory_bytes``, else ``memory_fraction`` of
    the free memory capped at ``max_tokens`` positions. ``EngineConfig`` names: ``kv_block_size``,
    ``kv_cache_memory_bytes``, ``kv_cache_memory_fraction`` (``max_tokens`` = max_batch_size x max_model_len)."""

    block_size: int = 16
    memory_bytes: Optional[int] = None
    memory_fraction: float = 0.1
    max_tokens: Optional[int] = None
    num_blocks: Optional[int] = None
    """An exact block count (tests, benchmarks); the engine sizes by memory."""

    @classmethod
    def from_config(cls, config) -> "KVBudget":
        """The budget an ``EngineConfig`` asks for."""
        return cls(
            block_size=config.kv_block_size,
            memory_bytes=config.kv_cache_memory_bytes,
            memory_fraction=config.kv_cache_memory_fraction,
            max_tokens=config.max_batch_size * config.max_model_len,
        )

    def blocks(self, bytes_per_block: int, device: torch.device) -> tuple[int, str]:
        """(number of blocks, how that was decided); raises ValueError / MemoryError naming the setting."""
        if self.num_blocks is not None:
            return self.num_blocks, f"{self.num_blocks} blocks as given"
        available = available_memory_bytes(device)
        if self.memory_bytes is not None:
            if available is not None and self.memory_bytes > 0.9 * available:
                raise MemoryError(
                    f"KV cache: kv_cache_memory_bytes={self.memory_bytes} ({self.memory_bytes / GIB:.2f} GiB) but "
                    f"{available / GIB:.2f} GiB is available on {device}: lower "
                    f"deployment.engine_config.kv_cache_memory_bytes (or leave it None and set kv_cache_memory_fraction)"
                )
            n, how = self.memory_bytes // bytes_per_block, f"kv_cache_memory_bytes={self.memory_bytes}"
        else:
            if available is None:
                n, how = UNKNOWN_MEMORY_BUDGET // bytes_per_block, "1 GiB: the free memory is unknown here"
            else:
                n = int(self.memory_fraction * available) // bytes_per_block
                how = f"kv_cache_memory_fraction={self.memory_fraction:g} of {available / GIB:.2f} GiB free"
            if self.max_tokens is not None:
                cap = -(-self.max_tokens // self.block_size)
                if cap < n:
                    n, how = cap, how + f", capped at max_batch_size x max_model_len = {self.max_tokens} tokens"
        if n < 1:
            raise ValueError(
                f"kv_cache_memory_bytes: the KV cache budget ({how}) holds no block of {self.block_size} tokens "
                f"({bytes_per_block} bytes): raise deployment.engine_config.kv_cache_memory_bytes or "
                f"kv_cache_memory_fraction"
            )
        return n, how


def bytes_per_block(
    num_layers: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, v_head_dim: int = 0
) -> int:
    """Bytes of one block: K and V of ``block_size`` positions in every layer and kv head."""
    return num_layers * num_kv_heads * block_size * (head_dim + (v_head_dim or head_dim)) * dtype.itemsize


class KVCache:
    """The block pool: per-layer K and V for ``num_blocks`` blocks plus the null block (module docstring)."""

    def __init__(
        self,
        num_layers: int,
        budget: KVBudget,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        v_head_dim: Optional[int] = None,
    ):
        v_head_dim = v_head_dim or head_dim
        bs = budget.block_size
        self.bytes_per_block = bytes_per_block(num_layers, num_kv_heads, bs, head_dim, dtype, v_head_dim)
        self.num_blocks, how = budget.blocks(self.bytes_per_block, torch.device(device))
        self.block_size = bs
        self.null_block = self.num_blocks
        shape = (num_layers, self.num_blocks + 1, num_kv_heads, bs)
        self.k_all = torch.empty(shape + (head_dim,), dtype=dtype, device=device)
        self.v_all = torch.empty(shape + (v_head_dim,), dtype=dtype, device=device)
        self.k = list(self.k_all.unbind(0))
        self.v = list(self.v_all.unbind(0))
        advise_huge_pages(self.k_all, self.v_all)
        self.touched = 0
        """Blocks ``[0, touched)`` have been handed out at least once (their pages are resident on CPU)."""
        self.zero_handed_out = True
        """Whether ``hand_out`` zeroes the block (the module docstring says when it need not)."""
        self.zero_block(self.null_block)
        logger.info("KV cache: %d blocks of %d tokens, %.2f GiB (%s)", self.num_blocks, bs, self.nbytes / GIB, how)
        self.sized_by = how
        """How the pool size was decided (``GET /stats`` ``kv_cache.sized_by``)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the pool's blocks (the null block not counted)."""
        return self.num_blocks * self.bytes_per_block

    def resident_bytes(self) -> int:
        """Bytes of the pool in memory: all of it on a GPU; on CPU the blocks handed out so far."""
        if self.k_all.device.type != "cpu":
            return self.nbytes
        return self.touched * self.bytes_per_block

    @torch.inference_mode()
    def zero_block(self, block: int) -> None:
        """Zero every layer's K and V of ``block``."""
        self.k_all[:, block].zero_()
        self.v_all[:, block].zero_()
        self._count_touched(block)

    def hand_out(self, block: int) -> None:
        """``block`` is about to be written by a sequence: zero it (if ``zero_handed_out``) and count it touched."""
        if self.zero_handed_out:
            self.zero_block(block)
        else:
            self._count_touched(block)

    def _count_touched(self, block: int) -> None:
        if block < self.num_blocks:  # the null block (last) is not one of the budget's blocks
            self.touched = max(self.touched, block + 1)

    @torch.inference_mode()
    def copy_block(self, src: int, dst: int, n: int) -> None:
        """K/V of the first ``n`` positions of block ``src`` into block ``dst`` (every layer at once)."""
        if n > 0 and src != dst:
            self.k_all[:, dst, :, :n].copy_(self.k_all[:, src, :, :n])
            self.v_all[:, dst, :, :n].copy_(self.v_all[:, src, :, :n])

    def restored(self) -> None:
        """After sleep.py gave the storage back (new, untouched memory): the null block zeroed, nothing touched."""
        advise_huge_pages(self.k_all, self.v_all)
        self.touched = 0
        self.zero_block(self.null_block)

    # ---- addressing (torch paths) ---------------------------------------------------------
    def flat_rows(self, kv_slots: torch.Tensor) -> torch.Tensor:
        """Rows of a layer's cache viewed as ``[-1, head_dim]`` for the KV slots ``kv_slots`` [N]: [N, kv_heads],
        token-major then head (what ``write`` indexes)."""
        kh, bs = self.k_all.shape[2], self.block_size
        heads = torch.arange(kh, device=kv_slots.device)
        block, offset = kv_slots // bs, kv_slots % bs
        return ((block * kh)[:, None] + heads[None, :]) * bs + offset[:, None]

    def write(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k`` [N, kv_heads, d] and ``v`` at ``rows`` (``flat_rows`` of the tokens' KV slots)."""
        kc, vc = self.k[layer], self.v[layer]
        rows = rows.reshape(-1)
        kc.view(-1, kc.shape[-1])[rows] = k.reshape(-1, kc.shape[-1])
        vc.view(-1, vc.shape[-1])[rows] = v.reshape(-1, vc.shape[-1])

    def gather(self, layer: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``tables`` [R, W] lists, laid out per row: [R, kv_heads, W x block_size, d]."""
        return gather_blocks(self.k[layer], tables), gather_blocks(self.v[layer], tables)


HUGE_PAGE = 2 * 1024**2
_MADV_HUGEPAGE = 14


def advise_huge_pages(*tensors: torch.Tensor) -> None:
    """Ask Linux to back the CPU tensors with transparent huge pages (``madvise(MADV_HUGEPAGE)``; a no-op elsewhere).

    A sequence's blocks lie anywhere in the pool, so decode attention jumps between them: on 4 KB pages
    nearly every block of every layer costs a TLB miss, on 2 MB pages hardly any. Pages still become
    resident only when touched (2 MB at a time, so a pool holds up to 2 MB per layer more than its
    blocks in use)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return
    for t in tensors:
        if t.device.type != "cpu" or t.nbytes < HUGE_PAGE:
            continue
        start = -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE
        end = (t.data_ptr() + t.nbytes) // HUGE_PAGE * HUGE_PAGE
        if end > start:
            libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """The K (or V) of the blocks ``tables`` [R, W] lists, from one layer's ``[blocks + 1, K, block_size, d]``
    cache, laid out per row: [R, K, W x block_size, d] (a copy)."""
    r, w = tables.shape
    got = cache.index_select(0, tables.reshape(-1))  # [R W, K, bs, d]
    kh, bs, d = got.shape[1:]
    return got.view(r, w, kh, bs, d).transpose(1, 2).reshape(r, kh, w * bs, d)


def kv_slots(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    """Flat KV slots of positions ``[start, stop)`` of a sequence with block table ``table``."""
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def padded_tables(tables: list[list[int]], width: int, null_block: int) -> list[list[int]]:
    """Block tables padded with ``null_block`` to ``width`` entries each."""
    return [t + [null_block] * (width - len(t)) for t in tables]
