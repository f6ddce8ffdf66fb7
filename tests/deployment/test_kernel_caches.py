"""The server bounds oneDNN's per-shape kernel caches: new matmul shapes stop adding to the heap once they are full.

A prefill's row count changes at almost every step; with the libraries' default capacities (1024 shapes in each of
two caches, ~0.5 MB a shape) that filled the server's heap by hundreds of MB (``kernel_caches.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from training.deployment.server.kernel_caches import CAPACITY_VARIABLES, LIBRARY_DEFAULT, bound_kernel_caches

SHAPES = 300
CAPACITY = 8

PROBE = f"""
import json, sys
from training.deployment.server.kernel_caches import bound_kernel_caches
bounds = bound_kernel_caches({CAPACITY})
import torch
from training.deployment.server.process_stats import heap_bytes
torch.set_grad_enabled(False)
packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(192, 64), None)
x = torch.randn({SHAPES}, 64)
torch.ops.mkldnn._linear_pointwise(x[:1], packed, None, "none", [], "")
before = heap_bytes()[0]
for m in range(2, {SHAPES} + 1):  # every call a new row count, as prefills are
    torch.ops.mkldnn._linear_pointwise(x[:m], packed, None, "none", [], "")
print(json.dumps({{"bounds": bounds, "grown": heap_bytes()[0] - before}}))
"""


def _mkldnn_linear() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


@pytest.mark.skipif(not _mkldnn_linear(), reason="torch built without oneDNN linears")
def test_new_matmul_shapes_stop_growing_the_heap_at_the_cache_bound():
    env = {k: v for k, v in os.environ.items() if k not in CAPACITY_VARIABLES}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bounds"] == {name: CAPACITY for name in CAPACITY_VARIABLES}
    if result["grown"] is None:
        pytest.skip("no glibc mallinfo2: the heap cannot be read here")
    # unbounded, 300 new shapes kept ~170 MB (0.57 MB each); bounded, at most 2 caches x 8 entries are kept
    assert result["grown"] < 48 * 2**20, f"the heap grew {result['grown'] / 2**20:.0f} MB over {SHAPES} shapes"


def test_a_capacity_set_by_the_user_wins(monkeypatch):
    monkeypatch.setenv(CAPACITY_VARIABLES[0], "512")
    monkeypatch.delenv(CAPACITY_VARIABLES[1], raising=False)
    assert bound_kernel_caches(64) == {CAPACITY_VARIABLES[0]: 512, CAPACITY_VARIABLES[1]: 64}
    monkeypatch.delenv(CAPACITY_VARIABLES[1])
    from training.deployment.server.kernel_caches import kernel_cache_bounds

    assert kernel_cache_bounds()[CAPACITY_VARIABLES[1]] == LIBRARY_DEFAULT
    with pytest.raises(ValueError, match="capacity"):
        bound_kernel_caches(-1)
