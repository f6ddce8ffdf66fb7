"""Metrics: one ``metrics.jsonl`` per run, a console progress line, and wandb when configured.

Names are grouped by prefix: ``rollout/*``, ``train/*``, ``offpolicy/*``, ``perf/*``, ``eval/*``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

from training.utils.config import WandBConfig

logger = logging.getLogger(__name__)


def set_aside_steps_from(path: Path, first_step: int) -> int:
    """Move the rows of ``path`` (a .jsonl with a ``step`` per row) whose step is >= ``first_step``
    to ``<stem>.replaced.jsonl`` next to it; return how many moved.

    A run resumed from the checkpoint after step ``first_step - 1`` trains those steps again, so
    their old rows would show up twice in the curves. They are kept aside, not deleted.
    """
    if not path.exists():
        return 0
    keep, moved = [], []
    for line in path.read_text().splitlines(keepends=True):
        try:
            step = json.loads(line).get("step")
        except ValueError:
            step = None  # a torn last line of a killed run: set aside too
        (keep if isinstance(step, int) and step < first_step else moved).append(line)
    if moved:
        with path.with_name(f"{path.stem}.replaced.jsonl").open("a") as f:
            f.writelines(line if line.endswith("\n") else line + "\n" for line in moved)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(keep))
        tmp.replace(path)
    return len(moved)


def wandb_settings(cfg: WandBConfig, default_name: str, env: Optional[Mapping[str, str]] = None) -> dict:
    """``wandb.init`` arguments. The ``WANDB_*`` environment wins (``WANDB_MODE``, ``WANDB_PROJECT``,
    ``WANDB_ENTITY``, ``WANDB_NAME``); the config supplies the defaults, as wandb's own settings do."""
    env = os.environ if env is None else env
    return {
        "project": env.get("WANDB_PROJECT") or cfg.project,
        "entity": env.get("WANDB_ENTITY") or cfg.entity,
        "name": env.get("WANDB_NAME") or cfg.run_name or default_name,
        "mode": env.get("WANDB_MODE") or cfg.mode,
        "tags": cfg.tags,
    }


PROMPT_TEXT_CHARS = 200
"""How much of a row's prompt text ``rollouts.jsonl`` keeps when the row has no ``id``."""


def prompt_ref(row: dict) -> dict:
    """What ``rollouts.jsonl`` keeps of a row to find it again, small: ``{"row_id": ...}`` when the row has
    an ``id``; else the first ``PROMPT_TEXT_CHARS`` of its ``prompt`` (or its last message's text) as
    ``prompt``; else the count of its prompt token ids as ``prompt_tokens``; else nothing."""
    if not isinstance(row, dict):
        return {}
    if row.get("id") is not None:
        return {"row_id": row["id"]}
    text = row.get("prompt")
    messages = row.get("messages")
    if not isinstance(text, str) and isinstance(messages, list) and messages and isinstance(messages[-1], dict):
        text = messages[-1].get("content")
    if isinstance(text, str):
        return {"prompt": text[:PROMPT_TEXT_CHARS]}
    ids = row.get("prompt_token_ids", row.get("prompt_ids"))
    if isinstance(ids, list):
        return {"prompt_tokens": len(ids)}
    return {}


class MetricsLogger:
    """Append one JSON object per step to ``<log_path>/metrics.jsonl``; mirror to console and wandb.

    ``resume_step > 0`` (a run resumed at that step): rows of steps >= ``resume_step`` that a
    killed run had already written to ``metrics.jsonl`` and ``rollouts.jsonl`` are moved to
    ``*.replaced.jsonl``, since those steps are trained again.
    """

    def __init__(
        self,
        log_path: str | Path,
        total_steps: Optional[int],
        wandb_cfg: Optional[WandBConfig] = None,
        run_config: Optional[dict] = None,
        console: bool = True,
        resume_step: int = 0,
    ):
        self.path = Path(log_path) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step > 0:
            for path in (self.path, self.path.parent / "rollouts.jsonl"):
                moved = set_aside_steps_from(path, resume_step)
                if moved:
                    logger.info(
                        "resumed at step %d: %d rows of %s set aside in %s",
                        resume_step,
                        moved,
                        path.name,
                        f"{path.stem}.replaced.jsonl",
                    )
        self.total_steps = total_steps
        self.console = console
        self.t0 = time.perf_counter()
        self._wandb = None
        if wandb_cfg is not None and wandb_cfg.enabled:
            try:
                import wandb
            except ImportError:
                raise ImportError("wandb is configured but not installed: pip install -e '.[wandb]'") from None
            self._wandb = wandb.init(
                **wandb_settings(wandb_cfg, Path(log_path).name), config=run_config, dir=str(log_path)
            )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time_s": round(time.perf_counter() - self.t0, 3)}
        row.update(
            {k: (v if isinstance(v, (int, str)) or v is None or math.isfinite(v) else None) for k, v in metrics.items()}
        )
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        if self.console:
            print(self.progress_line(step, metrics), file=sys.stderr, flush=True)

    def log_rollouts(self, step: int, groups: list) -> None:
        """Append one line per trained sample to ``rollouts.jsonl``: what was trained, and why."""
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            for g in groups:
                for sample, completion, advantage in zip(g.samples, g.completion_index, g.advantages):
                    f.write(
                        json.dumps(
                            {
                                "step": step,
                                "row_position": g.position,
                                "row_index": getattr(g, "row_index", None),
                                **prompt_ref(g.row),
                                "completion": completion,
                                "submit_version": g.submit_version,
                                "reward": sample.reward,
                                "advantage": advantage,
                                "finish_reason": sample.finish_reason,
                                "tokens": len(sample.tokens),
                                "trainable_tokens": sample.num_trainable_tokens,
                                "text": sample.text[:2000],
                                "metadata": g.metadata.get(completion),
                            },
                            default=str,
                        )
                        + "\n"
                    )

    def progress_line(self, step: int, m: dict[str, float]) -> str:
        total = self.total_steps
        done = step + 1
        bar = ""
        if total:
            filled = int(20 * done / total)
            bar = f"[{'#' * filled}{'.' * (20 - filled)}] {done}/{total} "
        parts = [f"step {step}", bar.strip()]
        for key, fmt in (
            ("rollout/reward_mean", "reward {:.3f}"),
            ("eval/reward_mean", "eval {:.3f}"),
            ("train/loss", "loss {:.4f}"),
            ("perf/step_time_s", "{:.1f} s/step"),
            ("offpolicy/staleness_mean", "stale {:.2f}"),
        ):
            if key in m and m[key] is not None:
                parts.append(fmt.format(m[key]))
        failed = sum(m.get(k) or 0 for k in ("rollout/errors", "rollout/timeouts", "rollout/invalid"))
        if failed:
            unprinted = m.get("rollout/failures_unprinted") or 0
            parts.append(f"{failed:.0f} rollouts failed" + (f" ({unprinted:.0f} not printed)" if unprinted else ""))
        return " | ".join(p for p in parts if p)

    def close(self) -> None:
        """Finish the wandb run (idempotent)."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def read_metrics(log_path: str | Path) -> list[dict]:
    """All rows of ``<log_path>/metrics.jsonl``."""
    path = Path(log_path) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
