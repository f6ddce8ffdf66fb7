"""The execution plan ``build_runner`` returns names the kernels around the decode step (the matmuls outside it, the
sampler), the runner and the engine follow it, it is logged once and ``/stats`` reports it."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from transformers import AutoConfig

from tests.deployment.engine.test_engine import PROMPTS, require_native, run_engine
from training.deployment.engine import SamplingParams
from training.deployment.engine.runners.build import build_runner
from training.deployment.engine.runners.lean import MATMUL_KERNELS, matmul_kernel
from training.utils.config import EngineConfig

CPU = torch.device("cpu")


def plan(path: str, caplog, **kw):
    """(runner, plan) of ``build_runner`` for the tiny model on CPU in fp32; asserts it logged the plan once."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="training.deployment.engine.runners.build"):
        config = EngineConfig(model=path, max_batch_size=2, max_model_len=32, **kw)
        runner, path_ = build_runner(config, AutoConfig.from_pretrained(path), path, CPU, torch.float32)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine path:")]
    assert lines == [f"engine path: {path_.describe()}"]
    assert f"matmuls {path_.matmul}, sampler {path_.sampler}" in lines[0]
    return runner, path_


def test_the_native_plan_runs_every_matmul_and_the_sampler_in_c(tiny_model_path, caplog):
    require_native()
    runner, path = plan(tiny_model_path, caplog)
    assert (path.name, path.matmul, path.sampler) == ("native", "native", "native")
    assert runner.matmul == "native" and runner.native_linears and not runner.onednn


def test_the_torch_step_plan_names_the_matmul_kernel_the_runner_uses(tiny_model_path, caplog):
    runner, path = plan(tiny_model_path, caplog, decode_kernel="torch")
    assert path.name == "torch" and path.sampler == "torch"
    assert path.matmul == matmul_kernel(False, CPU, torch.float32) == runner.matmul
    assert path.matmul in MATMUL_KERNELS and runner.onednn == (path.matmul == "onednn")


def test_the_fallback_plan_uses_torch_kernels(tiny_model_path, caplog):
    _, path = plan(tiny_model_path, caplog, use_lean_forward=False)
    assert path.name == "hf_fallback" and path.kernels() == {"matmul": "torch", "sampler": "torch"}


def test_a_runner_refuses_a_matmul_kernel_that_cannot_run(tiny_model_path):
    from training.deployment.engine.kv_cache import KVBudget
    from training.deployment.engine.runners.lean import LeanModelRunner

    cfg = AutoConfig.from_pretrained(tiny_model_path)
    with pytest.raises(ValueError, match="matmul='native' cannot run with native=False"):
        LeanModelRunner(tiny_model_path, cfg, KVBudget(num_blocks=4), 32, torch.float32, CPU, False, matmul="native")


def test_the_engine_samples_with_the_plans_sampler_and_reports_the_kernels(tiny_model_path, monkeypatch):
    """``/stats`` carries the plan's kernels; the engine's plain rows go to the C sampler exactly when the plan
    says so (the plan is read, not the runner's attributes)."""
    require_native()
    import training.deployment.engine.token_sampler as token_sampler

    calls = []
    real = token_sampler._sample_plain_native
    monkeypatch.setattr(token_sampler, "_sample_plain_native", lambda *a: calls.append(1) or real(*a))
    plain = SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True, seed=3)

    async def body(eng):
        stats = eng.engine.stats()
        assert stats["execution_path"] == "native"
        assert stats["execution_kernels"] == {"matmul": "native", "sampler": "native"}
        await eng.generate(PROMPTS[0], plain)
        by_c = len(calls)
        eng.engine.execution_path = dataclasses.replace(eng.engine.execution_path, sampler="torch")
        await eng.generate(PROMPTS[0], plain)
        return by_c, len(calls)

    by_c, after = run_engine(tiny_model_path, body, decode_kernel="auto")
    assert by_c == 4 and after == by_c  # one C draw per token; none once the plan says torch
