"""Trackers: wandb and TensorBoard are checked before anything loads, and TensorBoard records metrics.jsonl.

The missing-wandb test runs for real in a venv without wandb (this project's default one); where wandb
is installed it is skipped and the offline-mode test runs instead.
"""

import importlib.util
import math

import numpy as np
import pytest

from training.recipes import rl_loop
from training.utils import DeployConfig, LossConfig, TensorBoardConfig, TrainerConfig, WandBConfig
from training.utils.config import ConfigError
from training.utils.metrics import MetricsLogger, check_trackers, read_metrics, wandb_settings

HAS_WANDB = importlib.util.find_spec("wandb") is not None
HAS_TENSORBOARD = importlib.util.find_spec("tensorboard") is not None
ROWS = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201], "answer": "x"} for i in range(16)]


@pytest.fixture(autouse=True)
def no_wandb_env(monkeypatch):
    for var in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_MODE", "WANDB_NAME"):
        monkeypatch.delenv(var, raising=False)


def length_reward(completion: str, row: dict) -> float:
    """Rewards that differ inside a group, so every step trains."""
    return (len(completion) % 5) / 4


def config(base_model, tmp_path, **kw):
    return rl_loop.Config(
        base_model=base_model,
        log_path=str(tmp_path / "run"),
        completions_per_prompt=2,
        prompt_groups_per_step=2,
        max_tokens=4,
        max_steps=2,
        export_final_model=False,
        reward_fn=length_reward,
        trainer=TrainerConfig(learning_rate=1e-3),
        loss=LossConfig(kl_beta=0.0),
        **kw,
    )


def test_wandb_project_in_the_environment_alone_turns_wandb_on(monkeypatch):
    assert not WandBConfig().enabled
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    cfg = WandBConfig()
    assert cfg.enabled and cfg.project_source == "WANDB_PROJECT"
    assert wandb_settings(cfg, "run")["project"] == "from-env"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert not cfg.enabled and check_trackers(cfg) == []


@pytest.mark.skipif(HAS_WANDB, reason="needs a venv without wandb")
def test_missing_wandb_is_one_line_naming_what_set_it(monkeypatch):
    with pytest.raises(ConfigError) as e:
        check_trackers(WandBConfig(project="x"))
    assert str(e.value) == "wandb.project is set but wandb is not installed: pip install wandb"
    monkeypatch.setenv("WANDB_PROJECT", "y")
    with pytest.raises(ConfigError, match="^WANDB_PROJECT is set but wandb is not installed: pip install wandb$"):
        check_trackers(WandBConfig())


@pytest.mark.skipif(HAS_WANDB, reason="needs a venv without wandb")
def test_missing_wandb_fails_the_run_before_anything_loads(tiny_model_path, tmp_path):
    cfg = config(tiny_model_path, tmp_path, wandb=WandBConfig(project="x"))
    with pytest.raises(ConfigError, match="^wandb.project is set but wandb is not installed: pip install wandb$"):
        rl_loop.main(cfg, rows=ROWS)
    assert not (tmp_path / "run").exists()  # the log folder (made before the trainer is built) was never made


def test_a_base_model_typo_fails_the_run_before_anything_loads(tmp_path):
    with pytest.raises(ConfigError, match="^base_model: 'smolm2' is no built-in model; did you mean 'smollm2'\\?"):
        rl_loop.main(config("smolm2", tmp_path), rows=ROWS)
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(not HAS_WANDB, reason="wandb is not installed")
def test_wandb_offline_mode_writes_a_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    log = MetricsLogger(tmp_path, total_steps=1, wandb_cfg=WandBConfig(project="p"), console=False)
    log.log(0, {"train/loss": 0.5})
    log.close()
    assert list((tmp_path / "wandb").glob("offline-run-*"))


def tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed: pip install -e '.[tensorboard]'")
def test_tensorboard_scalars_equal_metrics_jsonl(embedded_server, tiny_model_path, tmp_path):
    with embedded_server(fresh=True, max_batch_size=8) as server:  # fresh: the run pushes its weights
        cfg = config(
            tiny_model_path,
            tmp_path,
            deployment=DeployConfig(base_url=server.base_url),
            tensorboard=TensorBoardConfig(enabled=True),
        )
        assert rl_loop.main(cfg, rows=ROWS)["steps"] == 2
    rows = read_metrics(cfg.log_path)
    expected: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key not in ("step", "time_s") and isinstance(value, (int, float)) and math.isfinite(value):
                expected.setdefault(key, {})[row["step"]] = float(np.float32(value))  # event files hold float32
    got = tensorboard_scalars(tmp_path / "run" / "tensorboard")
    assert "train/loss" in got and set(got["train/loss"]) == {0, 1}
    assert got == expected


@pytest.mark.skipif(not HAS_TENSORBOARD, reason="tensorboard is not installed: pip install -e '.[tensorboard]'")
def test_a_resumed_run_replaces_the_redone_steps_in_tensorboard(tmp_path):
    tb = TensorBoardConfig(enabled=True)
    first = MetricsLogger(tmp_path, total_steps=4, console=False, tensorboard_cfg=tb)
    for step in range(4):
        first.log(step, {"train/loss": float(step), "rollout/samples": 4, "eval/reward_mean": float("nan")})
    first.close()
    resumed = MetricsLogger(tmp_path, total_steps=4, console=False, tensorboard_cfg=tb, resume_step=2)
    for step in (2, 3):
        resumed.log(step, {"train/loss": 10.0 + step, "rollout/samples": 4})
    resumed.close()
    got = tensorboard_scalars(tmp_path / "tensorboard")
    assert got == {"train/loss": {0: 0.0, 1: 1.0, 2: 12.0, 3: 13.0}, "rollout/samples": {0: 4, 1: 4, 2: 4, 3: 4}}
