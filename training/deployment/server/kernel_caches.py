"""oneDNN's per-shape kernel caches in the server process: bounded at start, their bounds reported by ``GET /stats``.

torch's CPU matmuls on oneDNN (the engine's prefill linears on reordered weights,
``torch.ops.mkldnn._linear_pointwise``, and some ``F.linear`` shapes) keep each kernel they compile in two
caches keyed by the input's shape: oneDNN's primitive cache (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``) and
ideep's (``LRU_CACHE_CAPACITY``), 1024 entries each by default. An entry costs 0.3–0.6 MB whatever the
layer's size (measured: 0.57 MB per new shape of a 64 → 192 linear, 0.63 MB of a 576 → 1536 one). A
prefill's row count is the sum of the prompt lengths it packs, so it takes a new value at almost every
step: under the soak benchmark's traffic the server's heap grew by 0.7–1.6 MB per second, about 400 MB in
4 minutes, until both caches would have been full (424 MB for one linear's 1024 shapes). A fill, not a
leak, but a large one, and it gains little: a prefill shape seldom repeats, and compiling one costs
~2 ms.

``bound_kernel_caches`` sets both capacities (``KERNEL_CACHE_CAPACITY`` entries) before torch runs its
first matmul, unless the environment already sets them (the user's value wins); ``serve.main`` calls it
first. The decode step's shapes (one per batch size) are used every step, so the least-recently-used
eviction keeps them. With 128 entries each the soak levels off (4 minutes at 128 clients: heap in use
~177 MB and resident memory 384 MB from the second minute on, against 306 → 689 MB and still rising
with the libraries' 1024; BENCHMARKS.md, "soak").
"""

from __future__ import annotations

import os
from typing import Optional

KERNEL_CACHE_CAPACITY = 128
"""Entries each of oneDNN's two shape caches may hold in the server process (the libraries' default: 1024)."""
CAPACITY_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""The environment variables oneDNN and ideep read their capacities from, at their first use."""
LIBRARY_DEFAULT = 1024
"""Each cache's capacity when its variable is unset."""


def bound_kernel_caches(capacity: int = KERNEL_CACHE_CAPACITY) -> dict[str, int]:
    """Set each of ``CAPACITY_VARIABLES`` to ``capacity`` where the environment does not set it already.

    Takes effect only before torch's first oneDNN matmul in this process (call it before the engine
    loads); returns the capacities in effect (``kernel_cache_bounds``)."""
    if capacity < 0:
        raise ValueError(f"capacity: must be >= 0, got {capacity}")
    for name in CAPACITY_VARIABLES:
        os.environ.setdefault(name, str(capacity))
    return kernel_cache_bounds()


def kernel_cache_bounds() -> dict[str, Optional[int]]:
    """Each cache's capacity as this process's environment sets it (``LIBRARY_DEFAULT`` when unset; None when
    the value is not an integer, which the library then reads its own way)."""
    out: dict[str, Optional[int]] = {}
    for name in CAPACITY_VARIABLES:
        raw = os.environ.get(name)
        try:
            out[name] = LIBRARY_DEFAULT if raw is None else int(raw)
        except ValueError:
            out[name] = None
    return out
