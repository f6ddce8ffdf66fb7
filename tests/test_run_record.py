"""The run record and the log_path guards: no silent resume with other settings, no appending runs."""

import json

import pytest

from training.recipes.config import RESUME_MAY_CHANGE, Config
from training.utils.rl.losses import LossConfig
from training.utils.run_record import LogPathInUse, check_log_path, config_differences, write_config_record

pytestmark = pytest.mark.unit


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
