"""training.plot: metrics.jsonl → a PNG of the run's curves; bad input exits 2 with a message."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="training.plot needs matplotlib (extra 'plot')")

from training.plot import MetricsFileError, main, plot_metrics, read_metrics, rolling_mean  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _full_run(n_steps: int = 60) -> list[dict]:
    records = []
    for step in range(1, n_steps + 1):
        r = {
            "step": step,
            "rollout/reward_mean": 0.2 + 0.6 * (1 - math.exp(-step / 20)) + 0.05 * math.sin(step),
            "offpolicy/staleness_mean": 0.5 + 0.3 * math.sin(step / 5),
            "offpolicy/staleness_max": 2 if step % 7 else 3,
            "perf/rollout_time_s": 1.5,
            "perf/train_time_s": 0.8 + 0.01 * step,
            "perf/sync_time_s": 0.1,
            "perf/step_time_s": 2.4 + 0.01 * step,
            "train/loss": 1.0 / step,
            "train/note": "strings are skipped",
        }
        if step % 10 == 0:
            r["eval/accuracy"] = 0.1 + step / 100
        records.append(r)
    return records


def _assert_png(path: Path, min_bytes: int = 20_000) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert len(data) > min_bytes, f"{path} is only {len(data)} bytes"


def test_full_run_writes_png_with_all_panels(tmp_path):
    _write_jsonl(tmp_path / "run" / "metrics.jsonl", _full_run())
    out = plot_metrics(tmp_path / "run")
    assert out == tmp_path / "run" / "curves.png"
    _assert_png(out, min_bytes=40_000)


def test_partial_metrics_still_plot(tmp_path):
    records = [{"step": s, "rollout/reward_mean": s / 10} for s in range(20)]
    _write_jsonl(tmp_path / "metrics.jsonl", records)
    out = plot_metrics(tmp_path, out=tmp_path / "sub" / "reward.png")
    _assert_png(out, min_bytes=10_000)


def test_file_without_known_metrics_gets_no_data_panel(tmp_path):
    _write_jsonl(tmp_path / "metrics.jsonl", [{"step": 1, "custom/x": 3.0}, {"step": 2}])
    _assert_png(plot_metrics(tmp_path), min_bytes=5_000)


def test_missing_file_exits_2_with_message(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "metrics file not found" in capsys.readouterr().err


def test_empty_file_exits_2_with_message(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text("\n")
    assert main([str(tmp_path)]) == 2
    assert "metrics file is empty" in capsys.readouterr().err


def test_cli_subprocess_exit_codes(tmp_path):
    missing = subprocess.run(
        [sys.executable, "-m", "training.plot", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert missing.returncode == 2 and "metrics file not found" in missing.stderr
    _write_jsonl(tmp_path / "metrics.jsonl", _full_run(15))
    ok = subprocess.run(
        [sys.executable, "-m", "training.plot", str(tmp_path), "--out", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    _assert_png(tmp_path / "c.png")


def test_bad_record_names_line_and_field(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "a": 1}\n{"a": 2}\n')
    with pytest.raises(MetricsFileError, match=r"metrics.jsonl:2: field 'step'"):
        read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(MetricsFileError, match=r":2: not valid JSON"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_truncated_last_line_of_a_live_run_is_ignored(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 2.0}\n{"step": 2, "train/lo')
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series["train/loss"].steps == [1.0] and series["train/loss"].values == [2.0]


def test_read_metrics_keeps_numbers_only_and_their_steps(tmp_path):
    _write_jsonl(tmp_path / "metrics.jsonl", _full_run(20))
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert "train/note" not in series
    assert series["eval/accuracy"].steps == [10.0, 20.0]
    assert len(series["rollout/reward_mean"].values) == 20


def test_rolling_mean_is_trailing_window_mean():
    assert rolling_mean([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert rolling_mean([4.0], 10) == [4.0]
    with pytest.raises(ValueError, match="window"):
        rolling_mean([1.0], 0)


def test_step_time_panel_holds_durations_not_rates():
    from training.plot import _panels

    series = {
        k: ([0], [1.0])
        for k in ("perf/step_time_s", "perf/train_s", "perf/trained_tokens_per_s", "perf/generated_tokens_per_s")
    }
    ((title, keys),) = _panels(series)
    assert title == "step time (s)" and keys == ["perf/step_time_s", "perf/train_s"]
