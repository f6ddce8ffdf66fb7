"""metrics.jsonl and rollouts.jsonl of a resumed run: rows of redone steps are set aside, not lost."""

import json

from training.utils.metrics import MetricsLogger


def write_rows(path, steps, torn_tail=False):
    text = "".join(json.dumps({"step": s, "x": s * 10}) + "\n" for s in steps)
    path.write_text(text + ('{"step": 9, "x"' if torn_tail else ""))


def steps_in(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def test_resume_sets_aside_rows_of_redone_steps(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [0, 1, 2, 3, 4], torn_tail=True)
    write_rows(tmp_path / "rollouts.jsonl", [0, 0, 1, 2, 3, 3])
    log = MetricsLogger(tmp_path, total_steps=6, console=False, resume_step=3)
    assert steps_in(tmp_path / "metrics.jsonl") == [0, 1, 2]
    assert steps_in(tmp_path / "rollouts.jsonl") == [0, 0, 1, 2]
    aside = (tmp_path / "metrics.replaced.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in aside[:2]] == [3, 4] and aside[2] == '{"step": 9, "x"'
    assert steps_in(tmp_path / "rollouts.replaced.jsonl") == [3, 3]
    log.log(3, {"train/loss": 0.5})  # the redone step is appended after the kept rows
    assert steps_in(tmp_path / "metrics.jsonl") == [0, 1, 2, 3]


def test_fresh_run_leaves_files_alone(tmp_path):
    write_rows(tmp_path / "metrics.jsonl", [0, 1, 2])
    MetricsLogger(tmp_path, total_steps=6, console=False)
    assert steps_in(tmp_path / "metrics.jsonl") == [0, 1, 2]
    assert not (tmp_path / "metrics.replaced.jsonl").exists()


def test_wandb_environment_wins_over_the_config_defaults(monkeypatch):
    from training.utils.config import WandBConfig
    from training.utils.metrics import wandb_settings

    cfg = WandBConfig(project="p", entity="e", mode="online")
    assert wandb_settings(cfg, "run", env={}) == {
        "project": "p",
        "entity": "e",
        "name": "run",
        "mode": "online",
        "tags": [],
    }
    env = {"WANDB_MODE": "offline", "WANDB_PROJECT": "q", "WANDB_NAME": "n"}
    got = wandb_settings(cfg, "run", env=env)
    assert (got["mode"], got["project"], got["entity"], got["name"]) == ("offline", "q", "e", "n")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not cfg.enabled
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert cfg.enabled
