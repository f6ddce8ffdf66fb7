"""CUDA-graph replay of the lean decode step (CUDA only; not exercised on the CPU test machine).

A graph is keyed by (batch bucket, block-count bucket): the batch is padded up to the next size in
``cuda_graph_batch_sizes`` (clipped to ``max_batch_size``); padded rows decode token 0 at position 0
with a block table of null blocks (the pool's ``null_block``), so no sequence's block is written.
Every row's block table is padded with the null block to the bucket's width: the next power of two
≥ 16 blocks above the longest table (capped at the blocks ``max_model_len`` needs), so short
contexts do not pay for ``max_model_len``; attention gathers those blocks and masks past each row's
position. Graphs are captured lazily, on a bucket's first use, by ``_capture`` — the one place that
captures. Static input buffers (tokens, positions, block tables) are shared by every graph; each
graph owns its logits output. Weights are updated in place (``copy_``), so captured graphs stay
valid after an update; the pool's storage is fixed too (a sleep drops the graphs: sleep.py).
"""

from __future__ import annotations

import torch

from training.deployment.engine.kv_cache import padded_tables

MIN_BLOCK_BUCKET = 16
"""Fewest blocks a graph attends over (the first width bucket)."""


def _block_buckets(max_blocks: int) -> list[int]:
    out, n = [], MIN_BLOCK_BUCKET
    while n < max_blocks:
        out.append(n)
        n *= 2
    return out + [max_blocks]


class CudaGraphDecoder:
    """Per-bucket CUDA graphs of ``LeanModelRunner.decode_forward`` with static buffers."""

    def __init__(self, runner, batch_sizes: tuple[int, ...], max_batch_size: int, max_model_len: int):
        self.runner = runner
        cache = runner.cache
        self.batch_buckets = sorted({min(b, max_batch_size) for b in batch_sizes})
        self.block_buckets = _block_buckets(-(-max_model_len // cache.block_size))
        self.null = cache.null_block
        dev = runner.device
        n = self.batch_buckets[-1]
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.tables = torch.full((n, self.block_buckets[-1]), self.null, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _bucket(self, buckets: list[int], n: int) -> int | None:
        return next((b for b in buckets if b >= n), None)

    @torch.inference_mode()
    def _capture(self, bs: int, width: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture one decode step for ``bs`` rows over ``width`` blocks each."""
        args = self._args(bs, width)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.runner.decode_forward(*args)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.runner.decode_forward(*args)
        if self.pool is None:
            self.pool = graph.pool()
        torch.cuda.synchronize()
        return graph, out

    def _prepare(self, tables: list[list[int]], tokens: list[int], positions: list[int]) -> tuple[int, int] | None:
        """Fill the static buffers (padding rows: token 0 at position 0 over null blocks); return the
        (batch, width) bucket, or None when the batch is larger than every bucket."""
        b = len(tables)
        bs = self._bucket(self.batch_buckets, b)
        width = self._bucket(self.block_buckets, max(len(t) for t in tables))
        if bs is None or width is None:
            return None
        pad = bs - b
        self.tokens[:bs].copy_(torch.tensor(tokens + [0] * pad))
        self.positions[:bs].copy_(torch.tensor(positions + [0] * pad))
        rows = padded_tables(tables, width, self.null) + [[self.null] * width] * pad
        self.tables[:bs, :width].copy_(torch.tensor(rows))
        return bs, width

    def _args(self, bs: int, width: int) -> tuple:
        return self.tokens[:bs], self.positions[:bs], self.tables[:bs, :width]

    def run(self, tables: list[list[int]], tokens: list[int], positions: list[int]) -> torch.Tensor | None:
        """Replay the graph of this batch's bucket; None when the batch is larger than every bucket.

        The returned logits are a view of the graph's static output: consume them before the next run.
        """
        key = self._prepare(tables, tokens, positions)
        if key is None:
            return None
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out = self.graphs[key]
        graph.replay()
        return out[: len(tables)]

    @torch.inference_mode()
    def run_without_graph(
        self, tables: list[list[int]], tokens: list[int], positions: list[int]
    ) -> torch.Tensor | None:
        """The exact padded computation a graph captures, run eagerly (checks the graph math on CPU)."""
        key = self._prepare(tables, tokens, positions)
        if key is None:
            return None
        return self.runner.decode_forward(*self._args(*key))[: len(tables)]
