"""Smoke test of the benchmark harness (benchmarks are not tests; this only checks the harness works).

Runs the cheapest figure with ``--quick`` and checks its one JSON line; renders a report.
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quick_benchmark_prints_one_parsable_json_line_with_a_ratio():
    out = subprocess.run([sys.executable, "-m", "benchmarks.engine_throughput", "--quick"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    json_lines = [l for l in out.stdout.splitlines() if l.startswith("{")]
    assert len(json_lines) == 1
    result = json.loads(json_lines[0])
    assert result["figure"] == "engine_throughput"
    assert isinstance(result["ratio"], float) and result["ratio"] > 0
    assert {"cores", "gpu", "torch"} <= set(result["machine"])
    assert result["repeats"] >= 3
    for row in result["rows"]:
        assert row["value"] > 0 and row["baseline_value"] > 0
        assert abs(row["ratio"] - row["value"] / row["baseline_value"]) <= 0.01 * row["ratio"]


def test_report_flags_a_figure_worse_than_its_baseline():
    from benchmarks.report import render

    rows = [{"name": "fast", "value": 2.0, "unit": "tok/s", "baseline": "b", "baseline_value": 1.0, "ratio": 2.0},
            {"name": "slow", "value": 0.5, "unit": "tok/s", "baseline": "b", "baseline_value": 1.0, "ratio": 0.5},
            {"name": "slower sync", "value": 3.0, "unit": "s / step (lower is better)", "baseline": "b",
             "baseline_value": 1.0, "ratio": 3.0}]
    md = render({"date": "d", "command": "python -m benchmarks.run_all", "total_s": 1,
                 "results": [{"figure": "engine_throughput", "rows": rows, "machine": {"cores": 2}, "repeats": 3,
                              "seconds": 1.0}, {"figure": "exactness", "error": "timed out"}]})
    assert "| fast | 2 | tok/s | b | 1 | 2 |" in md
    assert "| slow | 0.5 | tok/s | b | 1 | 0.5 **(worse)** |" in md
    assert "3 **(worse)**" in md
    assert "Worse than its baseline:** slow vs b" in md
    assert "Not measured in this run:** timed out" in md


def test_rerunning_one_figure_keeps_the_others():
    from benchmarks.run_all import merge_results

    old = {"date": "d0", "command": "c", "total_s": 9, "results": [
        {"figure": "async_overlap", "rows": [1]}, {"figure": "async_agentic", "rows": [2]},
        {"figure": "exactness", "rows": [3]}]}
    new = {"date": "d1", "results": [{"figure": "async_agentic", "rows": [4]}]}
    merged = merge_results(old, new)
    assert [r["figure"] for r in merged["results"]] == ["async_overlap", "async_agentic", "exactness"]
    assert [r["rows"] for r in merged["results"]] == [[1], [4], [3]]
    assert merged["date"] == "d0" and merged["results"][1]["date"] == "d1"
