"""Decode attention over the paged KV cache: one query position per row.

``decode_attention``: plain rows, each over its own (gathered) keys. ``SharedPrefixAttention``: rows that
share one prefix's blocks (a GRPO group, ``n > 1``) read that prefix once per group. Used by the
lean forward's torch decode step (runners/lean.py); the C step has its own (native_decode.c).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from training.deployment.engine.kv_cache import gather_blocks

SHARED_ATTENTION_GAIN = 2.0
"""Decode takes the shared-prefix attention when it reads at least this many times fewer keys."""


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Attention of one query position per row, q [R, K, G, d] (G query heads per kv head) over
    k, v [R, K, L, d] with an additive mask [R, 1, 1, L]; returns [R, K, G, d].

    fp32 on CPU: ``softmax(q·kᵀ/√d + mask)·v`` as two batched matmuls. With one query position
    per row, SDPA's flash kernel sets up blocks per (row, head) that these matmuls skip: 7–18 %
    less time over 30 layers of uncached K/V at 32–64 rows and 100–700 keys (about even at 1,000).
    Elsewhere (bf16 scores would round, CUDA graphs) it is SDPA.
    """
    if q.dtype != torch.float32 or q.device.type != "cpu":
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    scores = torch.matmul(q * q.shape[-1] ** -0.5, k.transpose(-1, -2)).add_(mask)
    return torch.matmul(scores.softmax(-1), v)


@dataclass
class SharedPrefix:
    """Decode rows that hold the same K/V (the same blocks, or bitwise copies) at positions ``[0, length)``."""

    rows: list[int]
    length: int


class SharedPrefixAttention:
    """Decode attention that reads a prefix shared by several rows once, not once per row.

    The members of a GRPO group (and the choices of ``n > 1``) share their prompt's blocks. Attention
    of row ``i`` over keys ``[0, len_i)`` splits into the shared prefix ``[0, P)`` and the row's own
    suffix ``[P, len_i)``:

        prefix:  the queries of all the group's rows against the prefix blocks, gathered once (one
                 flash SDPA call per group, which also returns the log-sum-exp lse_p of the scores)
        suffix:  every grouped row against its own keys at once: they are gathered into
                 ``[rows, K, W, d]`` (W = the longest suffix, masked per row), scores s_s
        merge:   m = max(lse_p, max s_s),  o = (o_p·exp(lse_p - m) + Σ exp(s_s - m)·v) / (exp(lse_p - m) + Σ exp(s_s - m))

    which is softmax attention over the whole row (the same maths; the sums run in another order,
    ~1e-7 relative). Rows are cut into segments of consecutive rows with one shared prefix each, or
    none (rows of their own: :func:`decode_attention` over their gathered blocks). Keys read per layer:
    ``sum over groups of P + rows × (longest row - P)`` instead of ``rows × longest row``;
    :meth:`plan` returns None unless that is ``SHARED_ATTENTION_GAIN`` times fewer.
    """

    def __init__(
        self,
        groups: list[tuple[int, int, int, torch.Tensor]],
        alone: list[tuple[int, int, torch.Tensor, torch.Tensor]],
        grouped_rows: Optional[torch.Tensor],
        suffix_rows: torch.Tensor,
        suffix_mask: torch.Tensor,
    ):
        self.groups = groups
        """(first row, end row, shared prefix length P, the first row's blocks covering it) per group segment."""
        self.alone = alone
        """(first row, end row, block tables [rows, W], mask 0 / -inf [rows, 1, 1, W x block_size]) per segment of
        rows of their own."""
        self.grouped_rows = grouped_rows
        """Rows in a group segment, in order (None: every row)."""
        self.suffix_rows = suffix_rows
        """Flat rows of a layer's ``[blocks + 1, K, block_size, d]`` cache viewed as ``[-1, d]``: each grouped row's
        own keys, ``[rows, K, W]`` flattened (W = the longest own part; past its table: the null block, masked)."""
        self.suffix_mask = suffix_mask
        """0 / -inf [rows, 1, 1, W]: which of the W gathered keys a grouped row attends (fp32: the suffix is computed in fp32)."""

    @classmethod
    def plan(
        cls,
        positions: list[int],
        shared: Sequence[SharedPrefix],
        tables: list[list[int]],
        block_size: int,
        num_kv_heads: int,
        dtype: torch.dtype = torch.float32,
    ) -> Optional["SharedPrefixAttention"]:
        """Segments for a batch (``tables``: block tables padded to one width with the null block); None when plain
        attention reads about as much."""
        b = len(positions)
        group_of, prefix = [-1] * b, {}
        for gi, g in enumerate(shared):
            length = min([g.length, *(positions[r] for r in g.rows)])  # the current token is never in the prefix
            if len(g.rows) > 1 and length > 0:
                prefix[gi] = length
                for r in g.rows:
                    group_of[r] = gi
        if not prefix:
            return None
        width = len(tables[0])
        groups, alone, keys, r0 = [], [], 0, 0
        for r in range(1, b + 1):
            if r < b and group_of[r] == group_of[r0]:
                continue
            p = prefix.get(group_of[r0], 0) if r - r0 > 1 else 0  # a lone member reads its prefix in place
            end = max(positions[r0:r]) + 1
            if p:
                groups.append((r0, r, p, torch.tensor(tables[r0][: -(-p // block_size)])))
            else:
                alone.append(
                    (r0, r, torch.tensor(tables[r0:r]), _length_mask(range(width * block_size), positions[r0:r], dtype))
                )
            keys += p + (r - r0) * (end - p)
            r0 = r
        if b * (max(positions) + 1) < SHARED_ATTENTION_GAIN * keys or not groups:
            return None
        rows = [r for r0, r1, _, _ in groups for r in range(r0, r1)]
        starts = [p for r0, r1, p, _ in groups for _ in range(r0, r1)]
        own = max(positions[r] + 1 - p for r, p in zip(rows, starts))
        mask = _length_mask(range(own), [positions[r] - p for r, p in zip(rows, starts)], torch.float32)
        pos = (torch.tensor(starts)[:, None] + torch.arange(own)[None, :]).clamp(max=width * block_size - 1)
        blocks = torch.tensor([tables[r] for r in rows]).gather(1, pos // block_size)  # [rows, own]
        heads = torch.arange(num_kv_heads)[None, :, None]
        suffix_rows = (
            (blocks[:, None, :] * num_kv_heads + heads) * block_size + (pos % block_size)[:, None, :]
        ).reshape(-1)
        grouped = None if len(rows) == b else torch.tensor(rows)
        return cls(groups, alone, grouped, suffix_rows, mask)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """``q`` [B, K, G, d] (G query heads per kv head) over one layer's block cache; returns [B, K, G, d].

        The suffix and the merge run in fp32 (no-ops in fp32; in bf16 the scores would round).
        """
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        _, kh, g, d = q.shape
        o_pre, lse_pre = [], []
        for r0, r1, p, blocks in self.groups:
            m = r1 - r0
            k_pre, v_pre = (_blocks_as_rows(c, blocks)[:, :, :p] for c in (k_cache, v_cache))
            o, lse = flash(q[r0:r1].transpose(0, 1).reshape(1, kh, m * g, d), k_pre, v_pre)
            o_pre.append(o.view(kh, m, g, d).transpose(0, 1))
            lse_pre.append(lse.view(kh, m, g).transpose(0, 1))
        o_pre, lse_pre = torch.cat(o_pre).float(), torch.cat(lse_pre).float()
        qg = q if self.grouped_rows is None else q[self.grouped_rows]
        shape = (qg.shape[0], kh, self.suffix_mask.shape[-1], d)
        k_own = k_cache.view(-1, d).index_select(0, self.suffix_rows).view(shape).float()
        v_own = v_cache.view(-1, d).index_select(0, self.suffix_rows).view(shape).float()
        scores = torch.matmul(qg.float() * d**-0.5, k_own.transpose(-1, -2)).add_(self.suffix_mask)
        top = torch.maximum(scores.amax(dim=-1), lse_pre)
        weights = scores.sub_(top[..., None]).exp_()
        w_pre = lse_pre.sub_(top).exp_()
        mixed = torch.matmul(weights, v_own).add_(o_pre.mul_(w_pre[..., None]))
        mixed = mixed.div_(weights.sum(dim=-1).add_(w_pre)[..., None]).to(q.dtype)
        if self.grouped_rows is None:  # every row is in a group
            return mixed
        out = torch.empty_like(q)
        out[self.grouped_rows] = mixed
        for r0, r1, tables, mask in self.alone:
            k, v = gather_blocks(k_cache, tables), gather_blocks(v_cache, tables)
            out[r0:r1] = decode_attention(q[r0:r1], k, v, mask)
        return out


def _blocks_as_rows(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``gather_blocks`` of one table ``blocks`` [n]: [1, K, n x block_size, d]."""
    return gather_blocks(cache, blocks[None])


def _length_mask(keys: range, last: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Additive mask [rows, 1, 1, len(keys)]: 0 where key position <= the row's ``last``, else -inf."""
    visible = torch.tensor(keys)[None, :] <= torch.tensor(last)[:, None]
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))[:, None, None, :]
