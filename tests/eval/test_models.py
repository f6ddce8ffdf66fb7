"""training.eval.models: which weights a model spec names, refused in one line naming the option when none."""

import json
from pathlib import Path

import pytest

from training.eval.models import resolve_target, split_step
from training.eval.tasks import EvalArgumentError


def fake_run(folder: Path, final: bool = False, steps: tuple[int, ...] = ()) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"base_model": "tiny", "trainer": {}}))
    if final:
        (folder / "final").mkdir()
        (folder / "final" / "config.json").write_text("{}")
    for step in steps:
        ckpt = folder / "checkpoints" / f"step_{step:06d}"
        ckpt.mkdir(parents=True)
        (ckpt / ".metadata").write_bytes(b"x")
        (ckpt / "recipe_state.json").write_text(json.dumps({"step": step}))
    return folder


def test_split_step_reads_a_trailing_at_step_only():
    assert split_step("runs/x@10") == ("runs/x", 10)
    assert split_step("org/model") == ("org/model", None)
    assert split_step("a@b") == ("a@b", None)


def test_a_run_folder_serves_its_final_folder(tmp_path):
    run = fake_run(tmp_path / "run", final=True)
    target = resolve_target(str(run))
    assert target.model == str(run / "final") and target.run == str(run) and target.step is None


def test_a_run_without_final_names_its_checkpoint_steps(tmp_path):
    run = fake_run(tmp_path / "run", steps=(4, 8))
    with pytest.raises(EvalArgumentError, match=r"^--run: run .* has no exported final/ folder.*one of \[4, 8\]"):
        resolve_target(str(run), option="--run")


def test_a_missing_step_names_the_steps_there_are(tmp_path):
    run = fake_run(tmp_path / "run", steps=(4,))
    with pytest.raises(EvalArgumentError, match=r"no usable checkpoint at step 5 \(no such folder\).*\[4\]"):
        resolve_target(f"{run}@5")
    with pytest.raises(EvalArgumentError, match="names step 4 and --step says 5"):
        resolve_target(f"{run}@4", 5)


def test_a_step_of_a_plain_model_folder_is_refused(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(EvalArgumentError, match="a step needs a run folder"):
        resolve_target(str(tmp_path / "model"), 3)
