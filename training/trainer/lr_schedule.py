"""The learning-rate schedule: a warm-up, then ``constant``, ``linear`` or ``cosine`` decay to 0.

With W = ``warmup_steps``, T = the run's optimizer steps and s = 0, 1, ... the optimizer step,
the learning rate of step s is ``learning_rate * lr_factor(s)``:

    s < W:   (s + 1) / W                       (the first update is not wasted at 0)
    s >= W:  p = min((s - W) / (T - W), 1)
             constant: 1    linear: 1 - p    cosine: (1 + cos(pi * p)) / 2

so the last step s = T - 1 still trains (p < 1). ``constant`` needs no T. The step count is kept in
the optimizer's parameter groups (``SCHEDULE_STEP``), which checkpoints save and load with the rest
of the optimizer state: a resumed run continues the schedule where it stopped.
"""

from __future__ import annotations

import math
from typing import Optional

from training.utils.config import TrainerConfig

SCHEDULE_STEP = "schedule_step"
"""Parameter-group key holding the number of optimizer steps taken (saved with the optimizer state)."""


def lr_factor(schedule: str, step: int, warmup_steps: int, total_steps: Optional[int]) -> float:
    """The learning rate of optimizer step ``step`` as a fraction of the peak (see the module docstring)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"lr_schedule: {schedule!r} decays to 0 at the run's last step, so it needs the total steps")
    progress = min((step - warmup_steps) / max(total_steps - warmup_steps, 1), 1.0)
    if schedule == "linear":
        return 1.0 - progress
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"lr_schedule: unknown schedule {schedule!r}")


def check_schedule(cfg: TrainerConfig, total_steps: Optional[int]) -> None:
    """Refuse a decaying schedule without a total, or with a warm-up that fills the whole run."""
    if cfg.lr_schedule == "constant":
        return
    if total_steps is None:
        raise ValueError(
            f"lr_schedule: {cfg.lr_schedule!r} decays to 0 at the run's end, which needs max_steps; "
            "set max_steps, or use lr_schedule=constant"
        )
    if cfg.warmup_steps >= total_steps:
        raise ValueError(
            f"warmup_steps: {cfg.warmup_steps} warm-up steps leave nothing of the {total_steps} optimizer steps "
            f"for the {cfg.lr_schedule} decay"
        )


class LrSchedule:
    """Sets each optimizer step's learning rate from the step count kept in the optimizer's parameter groups."""

    def __init__(self, cfg: TrainerConfig, total_steps: Optional[int] = None):
        check_schedule(cfg, total_steps)
        self.cfg = cfg
        self.total_steps = total_steps

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step ``step``."""
        return self.cfg.learning_rate * lr_factor(self.cfg.lr_schedule, step, self.cfg.warmup_steps, self.total_steps)

    @staticmethod
    def step_of(optimizer) -> int:
        """Optimizer steps taken so far (0 for a fresh optimizer)."""
        return int(optimizer.param_groups[0].get(SCHEDULE_STEP, 0))

    def begin_step(self, optimizer) -> float:
        """Set the learning rate of the coming step on every parameter group; return it."""
        lr = self.lr(self.step_of(optimizer))
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr

    def end_step(self, optimizer) -> None:
        """Count the step (also one whose update was skipped, so the schedule stays aligned with the run)."""
        step = self.step_of(optimizer) + 1
        for group in optimizer.param_groups:
            group[SCHEDULE_STEP] = step
