"""CUDA-graph replay of the lean decode step (CUDA only; not exercised on the CPU test machine).

A graph is keyed by (batch bucket, key-length bucket): the batch is padded up to the next size
in ``cuda_graph_batch_sizes`` (clipped to ``max_batch_size``); padded rows decode token 0 at
position 0 into the KV cache's scratch slot, so no real slot is written. Attention runs over all
cache rows (``num_slots + 1``) and the first ``key_len`` keys, ``key_len`` the next power of two
≥ 256 above the longest position (capped at ``max_model_len``), so short contexts do not pay for
``max_model_len``. Graphs are captured lazily, on a bucket's first use, by ``_capture`` — the one
place that captures. Static input buffers are shared by every graph; each graph owns its logits
output. Weights are updated in place (``copy_``), so captured graphs stay valid after an update.
"""

from __future__ import annotations

import torch


def _key_len_buckets(max_model_len: int) -> list[int]:
    out, n = [], 256
    while n < max_model_len:
        out.append(n)
        n *= 2
    return out + [max_model_len]


class CudaGraphDecoder:
    """Per-bucket CUDA graphs of ``LeanModelRunner.decode_forward`` with static buffers."""

    def __init__(self, runner, batch_sizes: tuple[int, ...], max_batch_size: int, max_model_len: int):
        self.runner = runner
        self.batch_buckets = sorted({min(b, max_batch_size) for b in batch_sizes})
        self.len_buckets = _key_len_buckets(max_model_len)
        self.num_rows = runner.cache.num_slots + 1
        self.scratch = runner.cache.scratch_slot
        dev = runner.device
        n = self.batch_buckets[-1]
        self.tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), self.scratch, dtype=torch.long, device=dev)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = None

    def _bucket(self, buckets: list[int], n: int) -> int | None:
        return next((b for b in buckets if b >= n), None)

    @torch.inference_mode()
    def _capture(self, bs: int, key_len: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up on a side stream, then capture one decode step for ``bs`` rows and ``key_len`` keys."""
        args = self._args(bs, key_len)
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

    def _prepare(self, slots: list[int], tokens: list[int], positions: list[int]) -> tuple[int, int] | None:
        """Fill the static buffers (padding rows → scratch slot); return the (batch, key-length) bucket."""
        b = len(slots)
        bs = self._bucket(self.batch_buckets, b)
        key_len = self._bucket(self.len_buckets, max(positions) + 1)
        if bs is None or key_len is None:
            return None
        pad = bs - b
        self.tokens[:bs].copy_(torch.tensor(tokens + [0] * pad))
        self.positions[:bs].copy_(torch.tensor(positions + [0] * pad))
        self.slots[:bs].copy_(torch.tensor(slots + [self.scratch] * pad))
        return bs, key_len

    def _args(self, bs: int, key_len: int) -> tuple:
        return self.tokens[:bs], self.positions[:bs], self.slots[:bs], self.num_rows, key_len, False

    def run(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor | None:
        """Replay the graph of this batch's bucket; None when the batch is larger than every bucket.

        The returned logits are a view of the graph's static output: consume them before the next run.
        """
        key = self._prepare(slots, tokens, positions)
        if key is None:
            return None
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, out = self.graphs[key]
        graph.replay()
        return out[: len(slots)]

    @torch.inference_mode()
    def run_without_graph(self, slots: list[int], tokens: list[int], positions: list[int]) -> torch.Tensor | None:
        """The exact padded computation a graph captures, run eagerly (checks the graph math on CPU)."""
        key = self._prepare(slots, tokens, positions)
        if key is None:
            return None
        return self.runner.decode_forward(*self._args(*key))[: len(slots)]
