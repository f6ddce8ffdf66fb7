"""What an evaluation reports: a summary per model, a comparison of two, the console table, JSON and CSV.

A completion passes when its reward is > 0 (the recipes' ``eval/pass_rate`` rule). ``summarize`` gives
``pass@k`` for each requested k (the unbiased estimator of ``stats.py``, averaged over prompts) and the mean
reward over every completion with its 95 % normal-approximation interval. ``compare`` pairs the two models
prompt by prompt (same prompts, same seeds): each prompt's difference of mean rewards (B - A), and the mean
of those differences with its interval (a paired difference of means; it equals B's mean minus A's).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Optional

from training.eval.stats import mean_pass_at_k, mean_with_interval
from training.utils.rl.eval_rollouts import RowScores

REPORT_JSON = "eval.json"
REPORT_CSV = "eval.csv"


def default_ks(n: int) -> list[int]:
    """1, 2, 4, ... up to ``n``, and ``n`` itself."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def row_id(row: dict, index: int):
    """The row's ``id`` when it has one, else its index."""
    value = row.get("id") if isinstance(row, dict) else None
    return value if isinstance(value, (str, int, float)) else index


def summarize(scores: RowScores, ks: list[int]) -> dict:
    """``prompts``, ``samples``, ``failed``, ``reward_mean`` with ``reward_ci_low`` / ``reward_ci_high`` / ``ci_level``,
    ``pass@k`` per k."""
    counts = [(len(r), sum(1 for x in r if x > 0)) for r in scores.rewards_RS]
    interval = mean_with_interval(scores.flat_rewards)
    out = {
        "prompts": len(scores.rewards_RS),
        "samples": len(scores.flat_rewards),
        "failed": len(scores.failed),
        "reward_mean": interval.mean,
        "reward_ci_low": interval.low,
        "reward_ci_high": interval.high,
        "ci_level": interval.level,
    }
    out.update({f"pass@{k}": mean_pass_at_k(counts, k) for k in ks})
    return out


def per_prompt(scores: RowScores, rows: list[dict]) -> list[dict]:
    """One entry per prompt: ``index``, ``id``, ``rewards``, ``passed`` (completions with reward > 0), ``reward_mean``."""
    return [
        {
            "index": i,
            "id": row_id(row, i),
            "rewards": rewards,
            "passed": sum(1 for x in rewards if x > 0),
            "reward_mean": sum(rewards) / len(rewards),
        }
        for i, (row, rewards) in enumerate(zip(rows, scores.rewards_RS))
    ]


def compare(a: RowScores, b: RowScores) -> dict:
    """B - A per prompt and in the mean (paired over prompts): ``reward_mean_difference`` with its interval,
    ``prompts_differing``, ``per_prompt_difference``."""
    diffs = [sum(rb) / len(rb) - sum(ra) / len(ra) for ra, rb in zip(a.rewards_RS, b.rewards_RS)]
    interval = mean_with_interval(diffs)
    return {
        "reward_mean_difference": interval.mean,
        "difference_ci_low": interval.low,
        "difference_ci_high": interval.high,
        "ci_level": interval.level,
        "prompts_differing": sum(1 for d in diffs if d != 0),
        "per_prompt_difference": diffs,
    }


def table(report: dict) -> str:
    """The console table: one line per model (and one for the difference in a comparison)."""
    entries = [("A", report["model"], report["summary"])]
    if report.get("compare"):
        entries.append(("B", report["compare"]["model"], report["compare"]["summary"]))
    ks = [key for key in report["summary"] if key.startswith("pass@")]
    head = ["", "model", "prompts", "samples", "failed", "reward_mean [95% CI]"] + ks
    lines = []
    for tag, model, s in entries:
        ci = f"{s['reward_mean']:.3f} [{s['reward_ci_low']:.3f}, {s['reward_ci_high']:.3f}]"
        lines.append([tag, model["spec"], str(s["prompts"]), str(s["samples"]), str(s["failed"]), ci])
        lines[-1] += [f"{s[k]:.3f}" for k in ks]
    if report.get("compare"):
        d = report["compare"]["difference"]
        ci = f"{d['reward_mean_difference']:+.3f} [{d['difference_ci_low']:+.3f}, {d['difference_ci_high']:+.3f}]"
        lines.append(["B-A", f"{d['prompts_differing']} prompt(s) differ", "", "", "", ci] + [""] * len(ks))
    widths = [max(len(r[i]) for r in [head] + lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head] + lines)


def write_report(report: dict, out: Path) -> tuple[Path, Path]:
    """``out/eval.json`` (the whole report) and ``out/eval.csv`` (one line per prompt)."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / REPORT_JSON, out / REPORT_CSV
    json_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    other: Optional[list[dict]] = report["compare"]["prompts"] if report.get("compare") else None
    with csv_path.open("w", newline="") as f:
        writer = csv.writer(f)
        header = ["index", "id", "samples", "passed", "reward_mean"]
        if other is not None:
            header += ["passed_b", "reward_mean_b", "difference"]
        writer.writerow(header)
        for i, p in enumerate(report["prompts"]):
            line = [p["index"], p["id"], len(p["rewards"]), p["passed"], p["reward_mean"]]
            if other is not None:
                q = other[i]
                line += [q["passed"], q["reward_mean"], q["reward_mean"] - p["reward_mean"]]
            writer.writerow(line)
    return json_path, csv_path
