"""The run record and the log_path guards: no silent resume with other settings, no appending runs."""

import json

import pytest

from training.recipes.config import RESUME_MAY_CHANGE, Config
from training.utils.rl.losses import LossConfig
from training.utils.run_record import (
    LogPathInUse,
    check_log_path,
    config_differences,
    resolve_log_path,
    write_config_record,
)


def test_resume_with_another_loss_is_refused_naming_the_difference(tmp_path):
    old = Config(base_model="tiny", log_path=str(tmp_path), max_steps=4)
    write_config_record(tmp_path, old.to_dict())
    longer = Config(base_model="tiny", log_path=str(tmp_path), max_steps=8)  # extending a run is a resume
    check_log_path(tmp_path, longer.to_dict(), has_checkpoint=True, ignore=RESUME_MAY_CHANGE)
    other = Config(base_model="tiny", log_path=str(tmp_path), max_steps=4, loss=LossConfig(policy_loss="gspo"))
    with pytest.raises(LogPathInUse, match=r"loss.policy_loss: 'grpo' -> 'gspo'") as e:
        check_log_path(tmp_path, other.to_dict(), has_checkpoint=True, ignore=RESUME_MAY_CHANGE)
    assert "resume_with_changed_config=True" in str(e.value)
    check_log_path(tmp_path, other.to_dict(), has_checkpoint=True, ignore=RESUME_MAY_CHANGE, resume_anyway=True)


def test_a_second_run_without_checkpoints_never_appends(tmp_path):
    cfg = Config(base_model="tiny", log_path=str(tmp_path)).to_dict()
    check_log_path(tmp_path, cfg, has_checkpoint=False)  # empty folder: fine
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    with pytest.raises(LogPathInUse, match="already holds a run"):
        check_log_path(tmp_path, cfg, has_checkpoint=False)


def test_differences_are_dotted_and_ignore_whole_sections():
    old = {"a": 1, "deployment": {"port": 1}, "trainer": {"lr": 1.0, "x": [1]}}
    new = {"a": 1, "deployment": {"port": 2}, "trainer": {"lr": 2.0, "x": [1]}, "b": None}
    assert config_differences(old, new, ignore=("deployment",)) == ["trainer.lr: 1.0 -> 2.0"]


def _fake_run(folder, cfg: Config, checkpoint: bool) -> None:
    """A folder as a finished run leaves it: config.json, a metrics row and (optionally) a checkpoint."""
    folder.mkdir(parents=True, exist_ok=True)
    write_config_record(folder, cfg.to_dict())
    (folder / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")
    if checkpoint:
        (folder / "checkpoints" / "step_000001").mkdir(parents=True)
        (folder / "checkpoints" / "step_000001" / "recipe_state.json").write_text("{}")
        (folder / "checkpoints" / "step_000001" / ".metadata").write_bytes(b"dcp")  # a checkpoint from before manifests
        (folder / "checkpoints" / "latest").write_text("step_000001")


def test_resume_or_new_resumes_a_matching_run_and_numbers_a_different_one(tmp_path):
    run = tmp_path / "my_run"
    default = Config(base_model="tiny", log_path=str(run), max_steps=4)
    assert resolve_log_path(run, default.to_dict(), ignore=RESUME_MAY_CHANGE) == run  # nothing there yet
    _fake_run(run, default, checkpoint=True)
    longer = Config(base_model="tiny", log_path=str(run), max_steps=8)
    assert resolve_log_path(run, longer.to_dict(), ignore=RESUME_MAY_CHANGE) == run  # same settings: resume
    other = Config(base_model="tiny", log_path=str(run), loss=LossConfig(policy_loss="gspo"))
    second = tmp_path / "my_run-2"
    assert resolve_log_path(run, other.to_dict(), ignore=RESUME_MAY_CHANGE) == second
    _fake_run(second, other, checkpoint=True)
    assert resolve_log_path(run, other.to_dict(), ignore=RESUME_MAY_CHANGE) == second  # the matching one resumes
    assert resolve_log_path(run, default.to_dict(), ignore=RESUME_MAY_CHANGE) == run
    third = Config(base_model="tiny", log_path=str(run), seed=7).to_dict()
    assert resolve_log_path(run, third, ignore=RESUME_MAY_CHANGE) == tmp_path / "my_run-3"
    assert resolve_log_path(run, third, ignore=RESUME_MAY_CHANGE, resume_anyway=True) == run


def test_a_run_without_checkpoint_is_never_appended_to_under_any_policy(tmp_path):
    run = tmp_path / "r"
    cfg = Config(base_model="tiny", log_path=str(run))
    _fake_run(run, cfg, checkpoint=False)
    assert resolve_log_path(run, cfg.to_dict()) == tmp_path / "r-2"
    assert resolve_log_path(run, cfg.to_dict(), "new") == tmp_path / "r-2"
    for policy in ("resume", "error"):
        with pytest.raises(LogPathInUse, match="^error: ") as e:
            resolve_log_path(run, cfg.to_dict(), policy)
        assert "\n" not in str(e.value)  # one line
    assert (run / "metrics.jsonl").exists()
    assert resolve_log_path(run, cfg.to_dict(), "overwrite") == run
    assert not run.exists()  # the old run is deleted: overwrite says so


def test_overwrite_deletes_only_a_run_folder(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 0}) + "\n")  # no config.json: not a run folder
    with pytest.raises(LogPathInUse, match="left alone"):
        resolve_log_path(tmp_path, {}, "overwrite")
    assert (tmp_path / "metrics.jsonl").exists()


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="if_log_path_exists: 'sometimes'"):
        Config(base_model="tiny", if_log_path_exists="sometimes")


def test_a_refusal_is_one_line_without_traceback(tmp_path):
    """``LogPathInUse`` is a SystemExit: a script that runs into it prints its message only."""
    import subprocess
    import sys

    code = (
        "from training.utils.run_record import LogPathInUse\n"
        "raise LogPathInUse('error: log_path x already holds a run')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "error: log_path x already holds a run"
