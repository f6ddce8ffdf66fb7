"""Plot a run's training curves from its ``metrics.jsonl``.

    python -m training.plot LOG_PATH [--out FILE.png] [--window N]

``LOG_PATH`` is a run's log folder (or the ``metrics.jsonl`` file itself). Each line is one
JSON object with ``"step"`` and metric keys grouped by prefix (``rollout/*``, ``eval/*``,
``offpolicy/*``, ``perf/*``, ``train/*``). The PNG (default ``LOG_PATH/curves.png``) has up
to five panels, each drawn only when its metrics exist in the file:

- reward: ``rollout/reward_mean`` per step and its rolling mean over ``window`` points;
- eval: every ``eval/*`` key (e.g. ``eval/accuracy``) against step;
- staleness: ``offpolicy/staleness_mean`` and ``offpolicy/staleness_max``;
- step time: ``perf/*_s`` keys, stacked (``perf/step_time_s``, the total, drawn as a line);
- loss: ``train/loss``.

A file with none of these metrics gets a single "no data" panel. Needs matplotlib (extra
``plot``); drawing uses the Agg backend, so no display is needed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
DEFAULT_PNG = "curves.png"
TOTAL_STEP_TIME = "perf/step_time_s"


class MetricsFileError(ValueError):
    """The metrics file is missing, empty or not JSON lines with a ``step``."""


@dataclass
class Series:
    """One metric: ``values[i]`` was logged at ``steps[i]`` (steps in file order)."""

    steps: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


def metrics_path(log_path: str | Path) -> Path:
    """``LOG_PATH/metrics.jsonl`` for a folder, or ``log_path`` itself for a file."""
    path = Path(log_path)
    return path / METRICS_FILE if path.is_dir() else path


def read_metrics(path: str | Path) -> dict[str, Series]:
    """Numeric metrics of a JSON-lines file, by key. Non-numeric values are skipped.

    Raises ``MetricsFileError`` for a missing or empty file, a line that is not a JSON
    object, or a record without a numeric ``step``.
    """
    path = Path(path)
    if not path.is_file():
        raise MetricsFileError(f"metrics file not found: {path}")
    series: dict[str, Series] = {}
    n_records = 0
    with path.open() as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if not line.endswith("\n"):  # a last line cut short by a run still writing
                    break
                raise MetricsFileError(f"{path}:{line_no}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise MetricsFileError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
            step = record.get("step")
            if not _is_number(step):
                raise MetricsFileError(f"{path}:{line_no}: field 'step' missing or not a number: {step!r}")
            n_records += 1
            for key, value in record.items():
                if key != "step" and _is_number(value):
                    s = series.setdefault(key, Series())
                    s.steps.append(float(step))
                    s.values.append(float(value))
    if n_records == 0:
        raise MetricsFileError(f"metrics file is empty: {path}")
    return series


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def rolling_mean(values: list[float], window: int) -> list[float]:
    """Trailing mean: ``out[i] = mean(values[max(0, i - window + 1) : i + 1])``."""
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _panels(series: dict[str, Series]) -> list[tuple[str, list[str]]]:
    """(title, keys) for every panel that has data, in display order."""
    panels = []
    if "rollout/reward_mean" in series:
        panels.append(("reward", ["rollout/reward_mean"]))
    eval_keys = sorted(k for k in series if k.startswith("eval/"))
    if eval_keys:
        panels.append(("eval", eval_keys))
    stale_keys = [k for k in ("offpolicy/staleness_mean", "offpolicy/staleness_max") if k in series]
    if stale_keys:
        panels.append(("staleness (weight versions)", stale_keys))
    perf_keys = sorted(k for k in series if k.startswith("perf/") and k.endswith("_s") and not k.endswith("_per_s"))
    if perf_keys:
        panels.append(("step time (s)", perf_keys))
    if "train/loss" in series:
        panels.append(("train loss", ["train/loss"]))
    return panels


def _draw_step_time(ax, series: dict[str, Series], keys: list[str]) -> None:
    """Stack the parts of a step's time; the total, if logged, is a line over them."""
    parts = [k for k in keys if k != TOTAL_STEP_TIME]
    steps = series[parts[0]].steps if parts else []
    if parts and all(series[k].steps == steps for k in parts):
        ax.stackplot(steps, *[series[k].values for k in parts], labels=parts, alpha=0.7)
    else:  # parts logged at different steps cannot be stacked
        for k in parts:
            ax.plot(series[k].steps, series[k].values, label=k)
    if TOTAL_STEP_TIME in keys:
        s = series[TOTAL_STEP_TIME]
        ax.plot(s.steps, s.values, color="black", linewidth=1.2, label=TOTAL_STEP_TIME)


def plot_metrics(log_path: str | Path, out: str | Path | None = None, window: int = 10) -> Path:
    """Draw the curves of ``log_path`` (a log folder or a metrics file) into a PNG; return its path.

    ``out`` defaults to ``curves.png`` beside the metrics file; ``window`` is the number of
    points in the reward's rolling mean. Raises ``MetricsFileError`` for a missing or empty
    file and ``ImportError`` (naming the extra) when matplotlib is not installed.
    """
    if window < 1:
        raise ValueError(f"window: must be >= 1, got {window}")
    path = metrics_path(log_path)
    series = read_metrics(path)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install -e '.[plot]' (or: pip install matplotlib)") from e

    panels = _panels(series)
    fig, axes = plt.subplots(
        max(len(panels), 1), 1, figsize=(11, 2.8 * max(len(panels), 1)), sharex=True, squeeze=False
    )
    axes = axes[:, 0]
    if not panels:
        axes[0].text(
            0.5,
            0.5,
            "no data: none of rollout/reward_mean, eval/*, offpolicy/staleness_*,\nperf/*_s, train/loss in this file",
            ha="center",
            va="center",
            transform=axes[0].transAxes,
        )
        axes[0].set_axis_off()
    for ax, (title, keys) in zip(axes, panels):
        if title == "reward":
            s = series["rollout/reward_mean"]
            ax.plot(s.steps, s.values, alpha=0.35, label="rollout/reward_mean")
            ax.plot(s.steps, rolling_mean(s.values, window), linewidth=2, label=f"rolling mean ({window})")
        elif title.startswith("step time"):
            _draw_step_time(ax, series, keys)
        else:
            for k in keys:
                ax.plot(
                    series[k].steps,
                    series[k].values,
                    marker="o" if len(series[k].steps) < 30 else None,
                    markersize=3,
                    label=k,
                )
        ax.set_title(title, loc="left", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    axes[-1].set_xlabel("step")
    fig.suptitle(str(path.parent.name or path), fontsize=11)
    fig.tight_layout()
    out_path = Path(out) if out is not None else path.parent / DEFAULT_PNG
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 on success, 2 (with a message on stderr) for a missing or bad metrics file."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("log_path", metavar="LOG_PATH", help=f"run log folder holding {METRICS_FILE} (or the file)")
    p.add_argument("--out", default=None, help=f"PNG to write (default: LOG_PATH/{DEFAULT_PNG})")
    p.add_argument("--window", type=int, default=10, help="points in the reward's rolling mean")
    a = p.parse_args(argv)
    try:
        out = plot_metrics(a.log_path, a.out, a.window)
    except (MetricsFileError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
