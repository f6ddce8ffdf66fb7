"""The backend table (training/utils/backends.py) is the one place that knows a backend: the factory, the placement
and the config checks read its facts; impossible combinations are refused when the config is built, naming the
setting; no other production file tests a backend's name. No model, no server: ``unit`` (tests/conftest.py)."""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from training.deployment.backends.process import ServerProcess
from training.deployment.backends.registry import load_class, make_deployment, make_sampler
from training.deployment.placement import plan_placement
from training.utils.backends import BACKENDS, Backend
from training.utils.config import ConfigError, DeployConfig, EngineConfig

ROOT = Path(__file__).resolve().parents[2]
TABLE = ROOT / "training" / "utils" / "backends.py"


def labels(cfg: DeployConfig, num_gpus: int) -> list[str]:
    return [r.label for r in plan_placement(cfg, num_gpus=num_gpus, local_world_size=1).replicas]


# ----------------------------------------------------------------------- every backend's facts are read
@pytest.mark.parametrize("name", list(BACKENDS))
def test_the_factory_builds_the_classes_the_table_names(name):
    facts = BACKENDS[name]
    deployment = make_deployment("m", DeployConfig(engine=name))
    assert type(deployment) is load_class(facts.deployment)
    assert isinstance(deployment, ServerProcess) and deployment.engine == name
    sampler = make_sampler(["http://h:1"], DeployConfig(engine=name, request_timeout_s=7.0), tokenizer="tok")
    assert type(sampler) is load_class(facts.sampler)
    assert (getattr(sampler, "tokenizer", None) == "tok") is facts.sampler_tokenizer


@pytest.mark.parametrize("name", list(BACKENDS))
def test_placement_reads_multi_gpu_and_the_default_memory_share_from_the_table(name):
    facts = BACKENDS[name]
    wide = DeployConfig(engine=name, replica_devices=["cuda:1,2"])
    if facts.multi_gpu:
        assert labels(wide, num_gpus=3) == ["cuda:1,2"]
    else:
        with pytest.raises(ValueError, match=rf"^deployment.replica_devices: cuda:1,2: the {name} engine runs on one"):
            labels(wide, num_gpus=3)
    shared = DeployConfig(engine=name, num_replicas=2, replica_devices=["cuda:1"])
    budgeted = "gpu_memory_fraction" in facts.memory_settings and facts.default_gpu_memory_fraction is not None
    if budgeted and 2 * facts.default_gpu_memory_fraction > 1:
        with pytest.raises(ValueError, match="^deployment.gpu_memory_fraction:"):
            labels(shared, num_gpus=2)
        fitting = dataclasses.replace(shared, gpu_memory_fraction=0.5)
        assert labels(fitting, num_gpus=2) == ["cuda:1", "cuda:1"]
    else:
        assert labels(shared, num_gpus=2) == ["cuda:1", "cuda:1"]


def test_a_backend_added_to_the_table_is_deployed_placed_and_checked_without_other_changes(monkeypatch):
    """A new entry (here one that reuses vLLM's classes) needs nothing but the table: no KeyError anywhere."""
    new = dataclasses.replace(BACKENDS["vllm"], name="other", sleep_levels=(), default_gpu_memory_fraction=0.4)
    monkeypatch.setitem(BACKENDS, "other", new)
    cfg = DeployConfig(engine="other", num_replicas=2, replica_devices=["cuda:1"])
    assert labels(cfg, num_gpus=2) == ["cuda:1", "cuda:1"]  # 2 x 0.4 fits: its own default, read from the table
    assert type(make_deployment("m", cfg)).__name__ == "VLLMDeployment"
    with pytest.raises(ConfigError, match="^colocate: the other backend cannot"):
        DeployConfig(engine="other", colocate=True)
    with pytest.raises(
        ConfigError, match=r"^engine: 'tgi' is not 'auto' or one of \('embedded', 'vllm', 'sglang', 'other'\)"
    ):
        DeployConfig(engine="tgi")


def test_importing_the_registry_loads_no_backend():
    code = (
        "import sys, training.deployment.backends.registry; "
        "print([m for m in sys.modules if m.startswith('training.deployment.backends.') "
        "and m.rsplit('.', 1)[1] in ('embedded', 'vllm', 'sglang')])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------- refused when the config is built
@pytest.mark.parametrize(
    "kwargs, setting",
    [
        (dict(engine="sglang", colocate=True), "colocate"),
        (
            dict(engine="vllm", engine_config=EngineConfig(kv_cache_memory_bytes=2**30)),
            "engine_config.kv_cache_memory_bytes",
        ),
        (
            dict(engine="sglang", engine_config=EngineConfig(kv_cache_memory_fraction=0.3)),
            "engine_config.kv_cache_memory_fraction",
        ),
        (dict(engine="embedded", gpu_memory_fraction=0.5), "gpu_memory_fraction"),
        (dict(engine="vllm", engine_config=EngineConfig(num_threads=2)), "engine_config.num_threads"),
        (dict(engine="sglang", engine_config=EngineConfig(decode_kernel="torch")), "engine_config.decode_kernel"),
        (
            dict(engine="sglang", base_url="http://h:1", weight_sync="distributed", weight_sync_master_addr="h"),
            "weight_sync",
        ),
        (dict(engine="tgi"), "engine"),
    ],
)
def test_an_impossible_combination_is_a_config_error_naming_the_setting(kwargs, setting):
    with pytest.raises(ConfigError, match=f"^{setting}: "):
        DeployConfig(**kwargs)


def test_a_memory_setting_names_the_one_the_backend_reads():
    with pytest.raises(ConfigError, match="its memory is sized by gpu_memory_fraction"):
        DeployConfig(engine="vllm", engine_config=EngineConfig(kv_cache_memory_fraction=0.2))
    with pytest.raises(
        ConfigError, match="sized by engine_config.kv_cache_memory_bytes / engine_config.kv_cache_memory_fr"
    ):
        DeployConfig(gpu_memory_fraction=0.5)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_every_backend_accepts_the_defaults_and_what_it_reads(name):
    facts = BACKENDS[name]
    assert DeployConfig(engine=name).engine == name
    read = EngineConfig(device="cpu", dtype="float32", max_batch_size=3, max_model_len=99, seed=5)
    assert DeployConfig(engine=name, engine_config=read).engine_config.seed == 5
    if "gpu_memory_fraction" in facts.memory_settings:
        assert DeployConfig(engine=name, gpu_memory_fraction=0.3).gpu_memory_fraction == 0.3
    else:
        assert DeployConfig(engine=name, engine_config=EngineConfig(kv_cache_memory_bytes=2**20)).engine == name
    for level in facts.sleep_levels:
        assert DeployConfig(engine=name, colocate=True, sleep_level=level).colocate


def test_a_colocated_sglang_run_is_refused_when_its_command_line_is_read():
    from training.recipes.async_rl_loop import Config
    from training.utils.cli import apply_overrides

    with pytest.raises(SystemExit, match="colocate: the sglang backend cannot give its GPU memory back"):
        apply_overrides(Config(base_model="m"), ["deployment.engine=sglang", "deployment.colocate=true"])


def test_sglang_replicas_refuse_sleep_calls_instead_of_posting_a_route_sglang_lacks():
    dep = make_deployment("m", DeployConfig(engine="sglang"))
    for call in (lambda: dep.sleep(1), dep.wake_up, dep.is_sleeping):
        with pytest.raises(NotImplementedError, match="cannot sleep"):
            call()


# ----------------------------------------------------------------------- no name tests outside the table
def _names_compared(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, name) of each backend name a comparison, a ``match`` case or a dict key tests."""
    names = set(BACKENDS)

    def strings(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return [s for e in node.elts for s in strings(e)]
        return []

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            tested = [s for side in [node.left, *node.comparators] for s in strings(side)]
        elif isinstance(node, ast.MatchValue):
            tested = strings(node.value)
        elif isinstance(node, ast.Dict):
            tested = [s for k in node.keys if k is not None for s in strings(k)]
        else:
            continue
        found += [(getattr(node, "lineno", 0), s) for s in tested if s in names]
    return found


def test_no_production_file_but_the_table_tests_a_backend_name():
    hits = [
        f"{path.relative_to(ROOT)}:{line}: tests {name!r}"
        for path in sorted((ROOT / "training").rglob("*.py"))
        if path != TABLE
        for line, name in _names_compared(ast.parse(path.read_text()))
    ]
    assert not hits, "read a fact of training/utils/backends.py instead:\n" + "\n".join(hits)


def test_the_scan_sees_each_form_of_a_name_test():
    code = 'a == "vllm"\nb in ("x", "sglang")\nc = {"embedded": 1}\nmatch d:\n    case "vllm":\n        pass\n'
    assert sorted(name for _, name in _names_compared(ast.parse(code))) == ["embedded", "sglang", "vllm", "vllm"]
    assert _names_compared(ast.parse('engine = "vllm"\nf(engine="sglang")')) == []  # naming itself is no test


def test_backend_facts_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        BACKENDS["vllm"].multi_gpu = False  # type: ignore[misc]
    assert all(isinstance(b, Backend) and b.name == n for n, b in BACKENDS.items())
