"""The end-of-run summary: what was trained, how it went, where everything is, what to run next.

``run_summary`` reads the run's folder (``metrics.jsonl``, checkpoints, the final model) and
returns the text; ``log_summary`` logs it (rank 0 calls it once, at the end of ``run_recipe``) and
writes it to ``<log_path>/summary.txt``.
"""

from __future__ import annotations

import logging
import shlex
import sys
from pathlib import Path
from typing import Any, Optional

from training.utils.metrics import read_metrics
from training.utils.run_record import has_checkpoint

logger = logging.getLogger("training.recipe")

SUMMARY_FILE = "summary.txt"


def _first_last(rows: list[dict], key: str) -> Optional[str]:
    values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
    if not values:
        return None
    return f"{values[0]:.3f} -> {values[-1]:.3f}" if len(values) > 1 else f"{values[0]:.3f}"


def _wall(seconds: float) -> str:
    minutes, s = divmod(int(round(seconds)), 60)
    return f"{minutes} min {s} s" if minutes else f"{s} s"


def rerun_command(argv: Optional[list[str]] = None) -> Optional[str]:
    """The command line that started this process, when it was a script (``python train.py ...``)."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0].endswith(".py"):
        return None
    return " ".join(["python", *(shlex.quote(a) for a in argv)])


def run_summary(log_path: str | Path, result: dict[str, Any], start_step: int, wall_s: float) -> str:
    """The summary of a finished run in ``log_path``; ``result`` is ``run_recipe``'s return value."""
    log_path = Path(log_path)
    metrics = log_path / "metrics.jsonl"
    rows = read_metrics(log_path) if metrics.exists() else []
    steps = result.get("steps", 0)
    trained = steps - start_step
    if start_step:
        head = f"{trained} step(s) trained this time (resumed at step {start_step}, now at step {steps})"
    else:
        head = f"{steps} step(s)"
    lines = [f"run finished: {head}, in {_wall(wall_s)}"]
    for key, name in (("rollout/reward_mean", "reward (rollouts)"), ("eval/reward_mean", "eval reward")):
        shown = _first_last(rows, key)
        if shown is not None:
            lines.append(f"  {name}: {shown}" + (" (first -> last)" if "->" in shown else ""))
    if result.get("final_model"):
        lines.append(f"  final model:  {result['final_model']}")
    if result.get("output_model"):
        lines.append(f"  promoted to:  {result['output_model']}")
    lines.append(f"  metrics:      {metrics}")
    rollouts = log_path / "rollouts.jsonl"
    if rollouts.exists():
        lines.append(f"  rollouts:     {rollouts}")
    lines.append(f"  plot:         python -m training.plot {shlex.quote(str(log_path))}   (writes curves.png there)")
    if has_checkpoint(log_path):
        lines.append(f"  checkpoints:  {log_path / 'checkpoints'}")
        command = rerun_command()
        if command is None:
            again = "the same command with a larger max_steps"
        else:
            kept = [a for a in command.split(" ") if not a.startswith(("max_steps=", "log_path="))]
            again = " ".join([*kept, f"log_path={shlex.quote(str(log_path))}", "max_steps=<more>"])
        lines.append(f"  train longer: {again}   (resumes from the newest checkpoint)")
        note = _schedule_note(log_path, rows)
        if note:
            lines.append(note)
    return "\n".join(lines)


def _schedule_note(log_path: Path, rows: list[dict]) -> Optional[str]:
    """What "train longer" does to a decaying learning-rate schedule (None for ``constant`` or an unknown one).

    A ``linear`` / ``cosine`` schedule decays to 0 over the run's ``max_steps`` (``training/trainer/lr_schedule.py``),
    so a resume with a larger ``max_steps`` stretches it over the new length: the learning rate jumps back up from
    where it ended and decays again. The note says so, and how to go on at the last rate instead."""
    import json

    try:
        trainer = json.loads((log_path / "config.json").read_text()).get("trainer") or {}
    except (OSError, ValueError):
        return None
    schedule = trainer.get("lr_schedule")
    if schedule in (None, "constant"):
        return None
    lrs = [r["train/learning_rate"] for r in rows if isinstance(r.get("train/learning_rate"), (int, float))]
    last = f"{lrs[-1]:.3g}" if lrs else "<the last train/learning_rate>"
    return (
        f"  note: trainer.lr_schedule={schedule} decays over max_steps, so a larger max_steps restarts the decay "
        f"over the new length: the learning rate jumps back up from {last} (the last step's) and decays again. "
        f"To go on at {last} instead, add trainer.lr_schedule=constant trainer.learning_rate={last} "
        "resume_with_changed_config=true"
    )


def log_summary(log_path: str | Path, text: str) -> None:
    """Log the summary and write it to ``<log_path>/summary.txt``."""
    logger.info("%s", text)
    (Path(log_path) / SUMMARY_FILE).write_text(text + "\n")
