"""The learning-rate schedule: each optimizer step trains at the formula's rate, and a resumed run continues it."""

import math

import pytest

from training.recipes.config import Config
from training.trainer import PolicyTrainer
from training.trainer.lr_schedule import lr_factor
from training.utils.checkpoint import load_checkpoint, save_checkpoint
from training.utils.config import TrainerConfig

PEAK, WARMUP, TOTAL = 1e-2, 3, 10


def expected_lr(schedule: str, s: int) -> float:
    """The formula of training/trainer/lr_schedule.py, written out once more."""
    if s < WARMUP:
        return PEAK * (s + 1) / WARMUP
    p = min((s - WARMUP) / (TOTAL - WARMUP), 1.0)
    return PEAK * {"constant": 1.0, "linear": 1.0 - p, "cosine": 0.5 * (1 + math.cos(math.pi * p))}[schedule]


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
def test_lr_factor_follows_the_formula(schedule):
    lrs = [PEAK * lr_factor(schedule, s, WARMUP, TOTAL) for s in range(TOTAL)]
    assert lrs == pytest.approx([expected_lr(schedule, s) for s in range(TOTAL)], rel=1e-12)
    assert lrs[0] > 0 and lrs[-1] > 0  # no update is wasted at a rate of 0
    if schedule != "constant":
        assert lrs[WARMUP - 1] == pytest.approx(PEAK) and all(a > b for a, b in zip(lrs[WARMUP:], lrs[WARMUP + 1 :]))


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_a_decaying_schedule_without_max_steps_is_refused(schedule):
    with pytest.raises(ValueError, match="trainer.lr_schedule: .* needs max_steps"):
        Config(base_model="m", trainer=TrainerConfig(lr_schedule=schedule))
    with pytest.raises(ValueError, match="trainer.warmup_steps: 8 warm-up steps leave nothing of the run's 8"):
        Config(base_model="m", max_steps=4, ppo_epochs=2, trainer=TrainerConfig(lr_schedule=schedule, warmup_steps=8))
    ok = Config(base_model="m", max_steps=4, ppo_epochs=2, trainer=TrainerConfig(lr_schedule=schedule, warmup_steps=7))
    assert ok.optimizer_steps == 8
    assert Config(base_model="m", trainer=TrainerConfig(warmup_steps=5)).optimizer_steps is None  # constant: fine


def test_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="lr_schedule: 'step' is not one of"):
        TrainerConfig(lr_schedule="step")


def _step(trainer: PolicyTrainer) -> dict:
    """One real optimizer step on a small sequence (the loss raises its logprob)."""
    trainer.forward_backward([[5, 9, 2, 7, 3, 1]], lambda packed, lp: (-lp.sum(), {}))
    return trainer.optim_step()


def test_trainer_steps_at_the_scheduled_rate_and_a_resume_continues_it(tiny_model_path, tmp_path):
    cfg = TrainerConfig(device="cpu", learning_rate=PEAK, lr_schedule="cosine", warmup_steps=WARMUP)
    trainer = PolicyTrainer(tiny_model_path, cfg, total_steps=TOTAL)
    used = [_step(trainer)["learning_rate"] for _ in range(5)]
    assert used == pytest.approx([expected_lr("cosine", s) for s in range(5)], rel=1e-12)
    save_checkpoint(tmp_path, 5, trainer.model, trainer.optimizer, {"step": 5})
    after_save = [_step(trainer)["learning_rate"] for _ in range(5)]

    resumed = PolicyTrainer(tiny_model_path, cfg, total_steps=TOTAL)
    assert resumed.learning_rate == pytest.approx(expected_lr("cosine", 0))  # fresh: step 0
    load_checkpoint(tmp_path / "step_000005", resumed.model, resumed.optimizer)
    assert resumed.learning_rate == pytest.approx(expected_lr("cosine", 5))
    continued = [_step(resumed)["learning_rate"] for _ in range(5)]
    assert continued == pytest.approx(after_save, rel=1e-12)
    assert continued == pytest.approx([expected_lr("cosine", s) for s in range(5, 10)], rel=1e-12)
    for group in resumed.optimizer.param_groups:  # AdamW really stepped at that rate
        assert group["lr"] == pytest.approx(expected_lr("cosine", 9))


def test_trainer_refuses_a_decaying_schedule_without_total_steps(tiny_model_path):
    with pytest.raises(ValueError, match="lr_schedule: 'linear' decays to 0 .* needs max_steps"):
        PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", lr_schedule="linear"))
