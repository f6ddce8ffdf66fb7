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


def test_progress_line_shows_tokens_per_second_and_an_eta_from_recent_steps(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=10, console=False)
    first = log.progress_line(0, {"perf/step_time_s": 2.0, "perf/generated_tokens_per_s": 850.4})
    assert "850 tok/s" in first and "ETA 18s" in first  # 9 steps left at 2 s
    second = log.progress_line(1, {"perf/step_time_s": 4.0})
    assert "ETA 24s" in second  # mean of 2 s and 4 s, 8 steps left
    assert "ETA" not in log.progress_line(9, {"perf/step_time_s": 4.0})  # the last step: nothing left


def test_format_duration():
    from training.utils.metrics import format_duration

    assert [format_duration(s) for s in (0.4, 45, 750, 11100)] == ["0s", "45s", "12m30s", "3h05m"]


def test_a_sampled_completion_is_printed_every_sample_every_steps(tmp_path, capsys):
    from types import SimpleNamespace

    def group(rewards):
        samples = [
            SimpleNamespace(
                reward=r,
                text=f"answer {r}",
                finish_reason="stop",
                tokens=[1, 2],
                loss_mask=[0, 1],
                num_trainable_tokens=1,
            )
            for r in rewards
        ]
        return SimpleNamespace(
            samples=samples,
            completion_index=list(range(len(samples))),
            advantages=[0.0] * len(samples),
            position=0,
            row={"prompt": "What is 2+2?"},
            submit_version=0,
            metadata={},
        )

    log = MetricsLogger(tmp_path, total_steps=6, sample_every=2)
    for step in range(4):
        log.log_rollouts(step, [group([0.0, 1.0, 0.5])])
    printed = capsys.readouterr().err
    assert printed.count("--- sample at step") == 2 and "sample at step 2" in printed
    assert "reward 1.0 (best of 3" in printed and "completion: answer 1.0" in printed and "What is 2+2?" in printed
    MetricsLogger(tmp_path / "off", total_steps=6).log_rollouts(0, [group([1.0])])
    assert "sample at step" not in capsys.readouterr().err  # sample_every=0: never
