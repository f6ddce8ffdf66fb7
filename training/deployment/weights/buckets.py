"""Buckets of the distributed weight sync: consecutive tensors of one dtype flattened into one buffer.

The trainer broadcasts one flat buffer per bucket (not one tensor at a time) and synchronizes the
host once per push; the servers receive the buffer and copy each tensor's slice into place. Both
ends compute the same plan from the update's metadata (``dtypes``, ``shapes``, ``bucket_bytes``),
so only the bucket size travels. ``bucket_bytes`` 0 (or a tensor larger than the bucket) sends
that tensor on its own, received straight into the live weight when its dtype and device allow.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def tensor_bytes(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def plan_buckets(dtypes: Sequence[torch.dtype], shapes: Sequence[Sequence[int]], bucket_bytes: int) -> list[range]:
    """Index ranges of consecutive tensors that share a dtype and together fit in ``bucket_bytes``.

    Every tensor is in exactly one bucket, in order; a bucket never mixes dtypes; a tensor larger
    than ``bucket_bytes`` (every tensor, when it is 0) is a bucket of its own.
    """
    buckets: list[range] = []
    start, size = 0, 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        n = tensor_bytes(dtype, shape)
        if i > start and (dtype != dtypes[start] or size + n > bucket_bytes):
            buckets.append(range(start, i))
            start, size = i, 0
        size += n
    if len(dtypes) > start:
        buckets.append(range(start, len(dtypes)))
    return buckets
