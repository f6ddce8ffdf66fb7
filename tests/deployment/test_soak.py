"""The server under a long load: resident memory, open descriptors and every engine pool level off.

Runs ``SOAK_MINUTES`` (default 30) at ``SOAK_CLIENTS`` (default 128) against the real server on the
tiny model (``benchmarks/soak.py``), writes the samples' CSV and plot under the test's tmp folder
(``SOAK_OUT`` to keep them elsewhere), and asserts a plateau after warm-up of resident memory, the
C heap in use, open descriptors and the engine's session and prefix tables: the last third's max of
each series is at most the middle third's max × 1.05 plus a small slack. Deselected by default
(``pytest -m soak``).
"""

import os
from pathlib import Path

import pytest

from benchmarks.soak import JUDGED, SLACK, plateau, run_soak, table, write_outputs
from training.deployment.server.kernel_caches import KERNEL_CACHE_CAPACITY

MINUTES = float(os.environ.get("SOAK_MINUTES", "30"))
CLIENTS = int(os.environ.get("SOAK_CLIENTS", "128"))
SAMPLE_S = max(1.0, MINUTES * 60 / 120)  # about 120 samples whatever the length


def test_plateau_judges_growth():
    flat = [{"rss_mb": 300.0 + (i < 4) * i * 10} for i in range(12)]
    growing = [{"rss_mb": 300.0 + i * 20} for i in range(12)]
    assert plateau(flat, "rss_mb")[0]
    assert not plateau(growing, "rss_mb")[0]
    assert SLACK["rss_mb"] < 20 * 4  # the growth above exceeds the slack


@pytest.mark.soak
@pytest.mark.timeout(int(MINUTES * 60) + 900)
def test_server_memory_levels_off_under_load(tiny_model_path, tmp_path):
    result = run_soak(tiny_model_path, MINUTES, CLIENTS, SAMPLE_S, tmp_path)
    out = Path(os.environ.get("SOAK_OUT", tmp_path / "soak"))
    write_outputs(result, out, f"soak: {CLIENTS} clients, {MINUTES:g} min")
    print(table(result))
    assert result.rows[-1]["requests"] > CLIENTS, "the clients made almost no requests"
    assert result.errors == 0
    for column in JUDGED:
        ok, middle, last = plateau(result.rows, column)
        assert ok, f"{column} still grows after warm-up: middle third max {middle}, last third max {last}"
    for name in ("parked_sessions", "kv_cache_blocks"):
        bound = result.bounds[name]
        assert bound is not None and max(r[name] for r in result.rows) <= bound
    assert all(v <= KERNEL_CACHE_CAPACITY for v in result.kernel_caches.values()), result.kernel_caches
