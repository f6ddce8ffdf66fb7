"""Metrics: one ``metrics.jsonl`` per run, a console progress line (with an ETA and tokens/s, and every
``sample_every`` steps one sampled completion with its reward), and wandb / TensorBoard when configured.

Names are grouped by prefix: ``rollout/*``, ``train/*``, ``offpolicy/*``, ``perf/*``, ``eval/*``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Optional

from training.utils.config import ConfigError, TensorBoardConfig, WandBConfig

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


def check_trackers(wandb_cfg: Optional[WandBConfig], tensorboard_cfg: Optional[TensorBoardConfig] = None) -> list[str]:
    """The trackers a run will write to (``["wandb", "tensorboard"]``, or fewer); checked before anything loads.

    Raises ``ConfigError`` (one line, the ``pip install`` to run) when a tracker is switched on but its package
    is not installed. A package is looked up, not imported (importing wandb takes seconds).
    """
    on = []
    if wandb_cfg is not None and wandb_cfg.enabled:
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(f"{wandb_cfg.project_source} is set but wandb is not installed: pip install wandb")
        on.append("wandb")
    if tensorboard_cfg is not None and tensorboard_cfg.enabled:
        if importlib.util.find_spec("tensorboard") is None:
            raise ConfigError("tensorboard.enabled is set but tensorboard is not installed: pip install tensorboard")
        on.append("tensorboard")
    return on


def wandb_settings(cfg: WandBConfig, default_name: str, env: Optional[Mapping[str, str]] = None) -> dict:
    """``wandb.init`` arguments. The ``WANDB_*`` environment wins field by field (``WANDB_MODE``,
    ``WANDB_PROJECT``, ``WANDB_ENTITY``, ``WANDB_NAME``); the config supplies the defaults (``WandBConfig``)."""
    env = os.environ if env is None else env
    return {
        "project": env.get("WANDB_PROJECT") or cfg.project,
        "entity": env.get("WANDB_ENTITY") or cfg.entity,
        "name": env.get("WANDB_NAME") or cfg.run_name or default_name,
        "mode": env.get("WANDB_MODE") or cfg.mode,
        "tags": cfg.tags,
    }


def tracker_scalars(metrics: Mapping[str, object]) -> dict[str, float]:
    """The metrics a tracker records: numbers (bools and ints included), finite, under their own names."""
    return {
        k: v for k, v in metrics.items() if isinstance(v, (int, float)) and (isinstance(v, int) or math.isfinite(v))
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


ETA_WINDOW = 10
"""The ETA is the mean ``perf/step_time_s`` of the last this many steps times the steps left."""
SAMPLE_CHARS = 400
"""How much of a sampled completion (and of its prompt) the console shows every ``sample_every`` steps."""


def format_duration(seconds: float) -> str:
    """``3h05m``, ``12m30s`` or ``45s``: a duration as the progress line shows it."""
    seconds = int(round(max(seconds, 0.0)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def sample_block(step: int, group) -> Optional[str]:
    """One completion of ``group`` for the console: its prompt's start, the completion's text and its reward.
    The group's best-rewarded sample is shown (the first on a tie), so a run that starts learning shows it."""
    samples = list(getattr(group, "samples", None) or [])
    if not samples:
        return None
    best = max(
        range(len(samples)), key=lambda i: (samples[i].reward if samples[i].reward is not None else -math.inf, -i)
    )
    sample = samples[best]
    prompt = prompt_ref(group.row).get("prompt", "")
    text = (sample.text or "").strip()
    lines = [f"--- sample at step {step}: reward {sample.reward} (best of {len(samples)} in its group)"]
    if prompt:
        lines.append(f"prompt: {prompt[:SAMPLE_CHARS]}")
    lines.append(f"completion: {text[:SAMPLE_CHARS]}" + (" ..." if len(text) > SAMPLE_CHARS else ""))
    return "\n".join(lines)


def _mean_advantage(advantage, loss_mask: list[int]) -> float:
    """A sample's advantage for ``rollouts.jsonl``: the scalar, or a per-token advantage's mean over its trainable tokens."""
    if not isinstance(advantage, list):
        return advantage
    values = [a for a, m in zip(advantage, loss_mask) if m]
    return sum(values) / max(len(values), 1)


class MetricsLogger:
    """Append one JSON object per step to ``<log_path>/metrics.jsonl``; mirror to console, wandb and TensorBoard.

    Every numeric finite metric of a row goes to each tracker that is on, under its name, at the row's
    ``step`` (``tracker_scalars``). ``resume_step > 0`` (a run resumed at that step): rows of steps >=
    ``resume_step`` that a killed run had already written to ``metrics.jsonl`` and ``rollouts.jsonl`` are
    moved to ``*.replaced.jsonl``, since those steps are trained again; TensorBoard drops its own
    (``purge_step``). ``sample_every > 0`` prints one sampled completion with its reward to the console every
    that many steps (``sample_block``).
    """

    def __init__(
        self,
        log_path: str | Path,
        total_steps: Optional[int],
        wandb_cfg: Optional[WandBConfig] = None,
        run_config: Optional[dict] = None,
        console: bool = True,
        resume_step: int = 0,
        tensorboard_cfg: Optional[TensorBoardConfig] = None,
        sample_every: int = 0,
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
        self.sample_every = sample_every
        self._step_times: list[float] = []
        """The last ``ETA_WINDOW`` steps' ``perf/step_time_s``, for the ETA."""
        self.t0 = time.perf_counter()
        self._wandb = None
        self._tensorboard = None
        self.tensorboard_dir: Optional[Path] = None
        trackers = check_trackers(wandb_cfg, tensorboard_cfg)
        if "wandb" in trackers:
            import wandb

            self._wandb = wandb.init(
                **wandb_settings(wandb_cfg, Path(log_path).name), config=run_config, dir=str(log_path)
            )
        if "tensorboard" in trackers:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard_dir = Path(tensorboard_cfg.log_dir or Path(log_path) / "tensorboard")
            self._tensorboard = SummaryWriter(str(self.tensorboard_dir), purge_step=resume_step or None)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        row = {"step": step, "time_s": round(time.perf_counter() - self.t0, 3)}
        row.update(
            {k: (v if isinstance(v, (int, str)) or v is None or math.isfinite(v) else None) for k, v in metrics.items()}
        )
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self._wandb is not None:
            self._wandb.log(tracker_scalars(metrics), step=step)
        if self._tensorboard is not None:
            for key, value in tracker_scalars(metrics).items():
                self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()
        if self.console:
            print(self.progress_line(step, metrics), file=sys.stderr, flush=True)

    def log_rollouts(self, step: int, groups: list) -> None:
        """Append one line per trained sample to ``rollouts.jsonl``: what was trained, and why (``reward`` is the one
        trained on; ``reward_components``, only when the completion returned some, as returned). Every
        ``sample_every`` steps the console shows one of them (``sample_block``)."""
        if self.console and self.sample_every > 0 and step % self.sample_every == 0 and groups:
            block = sample_block(step, groups[0])
            if block:
                print(block, file=sys.stderr, flush=True)
        with (self.path.parent / "rollouts.jsonl").open("a") as f:
            for g in groups:
                components = getattr(g, "completion_components", {})
                for sample, completion, advantage in zip(g.samples, g.completion_index, g.advantages):
                    extra = {"reward_components": components[completion]} if completion in components else {}
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
                                "advantage": _mean_advantage(advantage, sample.loss_mask),
                                "finish_reason": sample.finish_reason,
                                "tokens": len(sample.tokens),
                                "trainable_tokens": sample.num_trainable_tokens,
                                "text": sample.text[:2000],
                                "metadata": g.metadata.get(completion),
                                **extra,
                            },
                            default=str,
                        )
                        + "\n"
                    )

    def progress_line(self, step: int, m: dict[str, float]) -> str:
        """``step 3 | [###...] 4/20 | reward 0.250 | ... | 2.1 s/step | 850 tok/s | ETA 34s``: the tokens/s are
        the step's generated tokens over its wall time (``perf/generated_tokens_per_s``), the ETA the mean step
        time of the last ``ETA_WINDOW`` steps times the steps left."""
        if m.get("perf/step_time_s") is not None:
            self._step_times = (self._step_times + [m["perf/step_time_s"]])[-ETA_WINDOW:]
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
            ("perf/generated_tokens_per_s", "{:.0f} tok/s"),
            ("offpolicy/staleness_mean", "stale {:.2f}"),
        ):
            if key in m and m[key] is not None:
                parts.append(fmt.format(m[key]))
        failed = sum(m.get(k) or 0 for k in ("rollout/errors", "rollout/timeouts", "rollout/invalid"))
        if failed:
            unprinted = m.get("rollout/failures_unprinted") or 0
            parts.append(f"{failed:.0f} rollouts failed" + (f" ({unprinted:.0f} not printed)" if unprinted else ""))
        if total and done < total and self._step_times:
            parts.append("ETA " + format_duration(sum(self._step_times) / len(self._step_times) * (total - done)))
        return " | ".join(p for p in parts if p)

    def close(self) -> None:
        """Finish the wandb run and close the TensorBoard writer (idempotent)."""
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def read_metrics(log_path: str | Path) -> list[dict]:
    """All rows of ``<log_path>/metrics.jsonl``."""
    path = Path(log_path) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
