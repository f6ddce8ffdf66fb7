"""Configs fail at construction with a message that names the field and what is allowed."""

import pytest

from training.recipes.async_rl_loop import Config
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig, WandBConfig


def test_negative_learning_rate_fails():
    with pytest.raises(ValueError, match="learning_rate: must be > 0"):
        TrainerConfig(learning_rate=-1e-5)


def test_unknown_loss_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="policy_loss: unknown loss 'ppo2'.*grpo"):
        LossConfig(policy_loss="ppo2")


@pytest.mark.parametrize(
    "make, field",
    [
        (lambda: TrainerConfig(dtype="fp8"), "dtype"),
        (lambda: TrainerConfig(device="tpu"), "device"),
        (lambda: TrainerConfig(num_threads=0), "num_threads"),
        (lambda: TrainerConfig(num_threads=True), "num_threads"),
        (lambda: EngineConfig(num_threads=-2), "num_threads"),
        (lambda: DeployConfig(port=70000), "port"),
        (lambda: DeployConfig(base_url="localhost:8000"), "base_url"),
        (lambda: DeployConfig(weight_sync="nccl"), "weight_sync"),
        (lambda: WandBConfig(mode="sometimes"), "mode"),
        (lambda: LossConfig(aggregation="median"), "aggregation"),
        (lambda: LossConfig(kl_beta=-1), "kl_beta"),
        (lambda: Config(base_model="m", completions_per_prompt=1), "completions_per_prompt"),
        (
            lambda: Config(base_model="m", weight_sync_interval=3, max_head_offpolicy_versions=1),
            "max_head_offpolicy_versions",
        ),
        (lambda: Config(base_model="m", temperature=0), "temperature"),
        (lambda: Config(base_model="m", stale_policy="discard"), "stale_policy"),
    ],
)
def test_bad_values_name_the_field(make, field):
    with pytest.raises(ValueError, match=f"^{field}:"):
        make()


def test_defaults_are_the_documented_ones():
    t, l = TrainerConfig(), LossConfig()
    assert (t.learning_rate, t.adam_betas, t.weight_decay) == (1e-5, (0.9, 0.95), 0.01)
    assert (l.policy_loss, l.kl_beta, l.tis_cap, l.aggregation) == ("grpo", 0.001, 5.0, "token_mean")
    assert DeployConfig().host == "127.0.0.1"
    assert (Config(base_model="m").stale_policy, Config(base_model="m").inflight_weight_updates) == ("wait", False)
    assert not WandBConfig().enabled and WandBConfig(project="p", mode="offline").enabled
    c = Config(base_model="m")
    assert c.max_head_offpolicy_versions == 0 and c.completions_per_prompt == 4
    assert c.to_dict()["loss"]["policy_loss"] == "grpo"


def test_custom_loss_callable_is_accepted():
    def my_loss(inputs, cfg):
        raise NotImplementedError

    assert LossConfig(policy_loss=my_loss).policy_loss is my_loss
    assert Config(base_model="m", loss=LossConfig(policy_loss=my_loss)).to_dict()["loss"]["policy_loss"] == "my_loss"


def test_deploy_engine_is_validated_and_lists_the_allowed_ones():
    assert DeployConfig().engine == "auto"  # resolved at a run's start (training/utils/engine_choice.py)
    assert DeployConfig(engine="vllm", engine_args=["--seed", "1"], engine_env={"A": "1"}).engine == "vllm"
    with pytest.raises(ValueError, match=r"^engine: 'tgi' is not 'auto' or one of \('embedded', 'vllm', 'sglang'\)"):
        DeployConfig(engine="tgi")
    with pytest.raises(ValueError, match="^engine_args:"):
        DeployConfig(engine="vllm", engine_args="--seed 1")
    with pytest.raises(ValueError, match="^engine_env:"):
        DeployConfig(engine="vllm", engine_env={"A": 1})


def test_dependency_floors_in_pyproject_are_the_versions_ci_tests():
    """pyproject's `>=` floors equal scripts/floors.txt, the pins .venv-floor is built from."""
    import re
    from pathlib import Path

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    root = Path(__file__).resolve().parents[2]
    deps = tomllib.loads((root / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = dict(re.match(r"([A-Za-z0-9_.-]+)>=([0-9][^,;]*)", d).groups() for d in deps)
    pins = dict(
        line.split("==")
        for line in (root / "scripts" / "floors.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    )
    assert set(floors) == set(pins)
    for name, floor in floors.items():
        pinned = tuple(int(x) for x in pins[name].split("."))
        stated = tuple(int(x) for x in floor.split("."))
        assert pinned[: len(stated)] == stated, f"{name}: pyproject says >={floor}, floors.txt pins {pins[name]}"
