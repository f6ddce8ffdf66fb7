"""The end-of-run summary's "train longer" hint under a decaying learning-rate schedule."""

from __future__ import annotations

import json
import sys

from training.utils.run_summary import run_summary


def _run(tmp_path, schedule: str):
    run = tmp_path / "r"
    (run / "checkpoints" / "step_000004").mkdir(parents=True)
    (run / "checkpoints" / "step_000004" / "recipe_state.json").write_text("{}")
    (run / "checkpoints" / "step_000004" / ".metadata").write_bytes(b"dcp")  # a checkpoint from before manifests
    (run / "checkpoints" / "latest").write_text("step_000004")
    rows = [{"step": k, "train/learning_rate": lr} for k, lr in enumerate([5e-4, 4.3e-4, 2.5e-4, 3.8e-5])]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "config.json").write_text(json.dumps({"trainer": {"lr_schedule": schedule, "learning_rate": 5e-4}}))
    return run


def test_the_train_longer_hint_says_a_decaying_schedule_restarts_and_how_to_keep_the_last_rate(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "max_steps=4"])
    text = run_summary(_run(tmp_path, "cosine"), {"steps": 4}, start_step=0, wall_s=1.0)
    note = text.splitlines()[-1]
    assert "train longer: python train.py" in text.splitlines()[-2]
    assert (
        "trainer.lr_schedule=cosine" in note and "restarts the decay" in note and "jumps back up from 3.8e-05" in note
    )
    assert "trainer.lr_schedule=constant trainer.learning_rate=3.8e-05 resume_with_changed_config=true" in note


def test_a_constant_schedule_gets_no_note(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["train.py", "max_steps=4"])
    text = run_summary(_run(tmp_path, "constant"), {"steps": 4}, start_step=0, wall_s=1.0)
    assert text.splitlines()[-1].startswith("  train longer: ") and "lr_schedule" not in text
