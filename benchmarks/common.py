"""What every benchmark script shares: machine facts, medians, model choice, the JSON line.

A figure's JSON line: ``{"figure", "baseline", "ratio", "unit", "rows": [...], "machine", "repeats",
"notes", "seconds"}``. ``ratio`` (top level) is the headline row's figure / its baseline; every row
carries its own ``value``, ``baseline_value`` and ``ratio``, all measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from typing import Any, Callable, Optional, Sequence

import torch


def machine() -> dict[str, Any]:
    """Cores, CPU model, GPU (None on CPU), torch and transformers versions."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {
        "cores": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }


def _cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of all CPUs since boot, from ``/proc/stat``."""
    with open("/proc/stat") as f:
        ticks = [int(x) for x in f.readline().split()[1:]]
    return ticks[3] + ticks[4], sum(ticks)


def wait_for_quiet_cpu(busy_below: float = 0.1, window_s: float = 0.5, timeout_s: float = 30.0) -> float:
    """Wait until the machine's CPUs are busy less than ``busy_below`` over ``window_s``; returns seconds waited.

    A server keeps computing for a moment after its last answer (vLLM's CPU build kept one core
    busy for about a second), so the next timed side would pay for it. Off Linux, returns at once.
    """
    t0 = time.perf_counter()
    if not os.path.exists("/proc/stat"):
        return 0.0
    while time.perf_counter() - t0 < timeout_s:
        idle0, total0 = _cpu_times()
        time.sleep(window_s)
        idle1, total1 = _cpu_times()
        if 1 - (idle1 - idle0) / max(1, total1 - total0) < busy_below:
            break
    return time.perf_counter() - t0


def median(values: Sequence[float]) -> float:
    """Median of a non-empty sequence."""
    if not values:
        raise ValueError("values: need at least one measurement")
    return float(statistics.median(values))


def sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (small figures such as 1e-6 keep their value)."""
    return float(f"{x:.{digits}g}")


def ratio(value: float, baseline: float) -> Optional[float]:
    """value / baseline, rounded; None when the baseline is 0 or missing."""
    if not baseline:
        return None
    return sig(value / baseline)


def row(name: str, value: float, unit: str, baseline_name: str, baseline_value: float, **extra: Any) -> dict:
    """One table row: a figure, its baseline measured in the same run, and their ratio."""
    return {
        "name": name,
        "value": sig(value),
        "unit": unit,
        "baseline": baseline_name,
        "baseline_value": sig(baseline_value),
        "ratio": ratio(value, baseline_value),
        **extra,
    }


def model_path(name: str) -> str:
    """``tiny`` (built from config), ``smollm2`` (converted from the wheel) or a folder."""
    if name == "tiny":
        from training.models.build_tiny import ensure_tiny_model

        return ensure_tiny_model()
    if name in ("smol", "smollm2"):
        from training.models.smollm2 import ensure_smollm2

        return ensure_smollm2()
    return name


def base_parser(doc: str) -> argparse.ArgumentParser:
    """Parser with the flags every script has: ``--quick`` and ``--repeats``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a much smaller workload (smoke test), tiny model only")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per figure (median reported; >= 3)")
    return p


def emit(
    figure: str,
    rows: list[dict],
    *,
    headline: int = 0,
    notes: str = "",
    started: float,
    repeats: int,
    extra: Optional[dict] = None,
) -> dict:
    """Print the figure's one JSON line (and return it). ``headline`` picks the row whose ratio is top-level."""
    if not rows:
        raise ValueError("rows: a figure needs at least one row")
    head = rows[headline]
    out = {
        "figure": figure,
        "baseline": head["baseline"],
        "ratio": head["ratio"],
        "unit": head["unit"],
        "rows": rows,
        "machine": machine(),
        "repeats": repeats,
        "notes": notes,
        "seconds": round(time.perf_counter() - started, 1),
        **(extra or {}),
    }
    print(json.dumps(out), flush=True)
    return out


def timed(fn: Callable[[], Any], repeats: int) -> tuple[list[float], list[Any]]:
    """Call ``fn`` ``repeats`` times; return the wall times and results."""
    times, results = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        results.append(fn())
        times.append(time.perf_counter() - t0)
    return times, results
