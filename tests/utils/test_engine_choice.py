"""``DeployConfig.engine="auto"``: vLLM on GPUs where it is installed and takes the config, else the embedded engine,
said in one line (training/utils/engine_choice.py). No GPU is needed: the rule takes the machine's GPU count, and an
installed vLLM is recognised by its venv's layout, which a test builds in a temporary folder (a stand-in for a vLLM
install: only the ``site-packages/vllm`` folder the rule looks for, nothing that runs)."""

import logging
import sys

import pytest

from training.recipes.config import Config
from training.recipes.resources import resolve_engines
from training.utils import engine_choice
from training.utils.config import DeployConfig, EngineConfig, backend
from training.utils.engine_choice import choose_engine, find_vllm_python, resolve_engine, venv_has_vllm


@pytest.fixture
def vllm_venv(tmp_path):
    """A venv folder with a ``vllm`` package folder where pip would put it (stand-in, see the module docstring)."""
    (tmp_path / "lib" / "python3.11" / "site-packages" / "vllm").mkdir(parents=True)
    (tmp_path / "bin").mkdir()
    python = tmp_path / "bin" / "python"
    python.write_text("")
    return str(python)


def test_on_the_cpu_auto_is_the_embedded_engine_and_says_nothing(vllm_venv):
    for deploy in (DeployConfig(), DeployConfig(engine_config=EngineConfig(device="cpu"))):
        choice = choose_engine(deploy, num_gpus=0, vllm_python=vllm_venv)
        assert (choice.name, choice.line) == ("embedded", None)
    # GPUs on the machine, but the config puts the replicas on the CPU
    for deploy in (DeployConfig(engine_config=EngineConfig(device="cpu")), DeployConfig(replica_devices=["cpu"])):
        assert choose_engine(deploy, num_gpus=8, vllm_python=vllm_venv).name == "embedded"
    assert backend("auto") is backend("embedded")  # before it is resolved


def test_on_gpus_with_vllm_installed_auto_launches_vllm_from_that_interpreter(vllm_venv):
    for deploy in (DeployConfig(), DeployConfig(replica_devices=["cuda:1"]), DeployConfig(colocate=True)):
        choice = choose_engine(deploy, num_gpus=2, vllm_python=vllm_venv)
        assert choice.name == "vllm" and choice.engine_python == vllm_venv
        assert vllm_venv in choice.line and "engine=embedded" in choice.line
    resolved, _ = resolve_engine(DeployConfig(), num_gpus=2) if find_vllm_python() else (None, None)
    if resolved is not None:  # this machine has a vLLM for GPUs: the resolved config launches it
        assert resolved.engine == "vllm" and resolved.engine_python


def test_on_gpus_without_vllm_auto_is_the_embedded_engine_called_the_small_model_path(monkeypatch, tmp_path):
    monkeypatch.setattr(engine_choice, "VLLM_GPU_VENV_PYTHON", tmp_path / "none" / "bin" / "python")
    if find_vllm_python() is not None:
        pytest.skip(f"{sys.executable} imports vllm")
    resolved, choice = resolve_engine(DeployConfig(), num_gpus=1)
    assert resolved.engine == "embedded" and "small-model path" in choice.line and "no vLLM found" in choice.line


def test_a_config_vllm_cannot_take_keeps_the_embedded_engine_naming_the_setting(vllm_venv):
    deploy = DeployConfig(engine_config=EngineConfig(kv_cache_memory_bytes=2**29))  # the SmolLM2 examples set it
    choice = choose_engine(deploy, num_gpus=4, vllm_python=vllm_venv)
    assert choice.name == "embedded"
    assert "engine_config.kv_cache_memory_bytes" in choice.line and vllm_venv in choice.line


def test_an_attached_server_and_an_explicit_engine_are_left_as_they_are(vllm_venv):
    attached = DeployConfig(base_url="http://127.0.0.1:9")
    assert choose_engine(attached, num_gpus=8, vllm_python=vllm_venv).name == "embedded"
    for name in ("embedded", "vllm", "sglang"):
        deploy = DeployConfig(engine=name)
        assert resolve_engine(deploy, num_gpus=8) == (deploy, engine_choice.EngineChoice(name))


def test_a_venv_without_vllm_is_not_taken_for_one(tmp_path, vllm_venv):
    (tmp_path / "empty" / "lib" / "python3.11" / "site-packages").mkdir(parents=True)
    assert venv_has_vllm(vllm_venv) and not venv_has_vllm(tmp_path / "empty" / "bin" / "python")
    assert find_vllm_python("/my/python") == "/my/python"  # engine_python given: that is the interpreter


def test_the_recipe_resolves_both_deployments_once_and_logs_the_choice(monkeypatch, vllm_venv, caplog):
    monkeypatch.setattr(engine_choice, "find_vllm_python", lambda engine_python=None: vllm_venv)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 2)
    cfg = Config(base_model="m")
    with caplog.at_level(logging.INFO, logger="training.recipe"):
        resolved = resolve_engines(cfg)
    assert resolved.deployment.engine == "vllm" and resolved.deployment.engine_python == vllm_venv
    assert resolved.distillation.deployment.engine == "vllm"
    lines = [r.getMessage() for r in caplog.records]
    assert sum(line.startswith("engine auto: vLLM") for line in lines) == 1
    assert sum(line.startswith("teacher engine auto: vLLM") for line in lines) == 1
    assert cfg.deployment.engine == "auto"  # the config as given (config.json) keeps it
    assert resolve_engines(cfg, main_rank=False).deployment.engine == "vllm"
