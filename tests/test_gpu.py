"""The GPU suite: the same real parts as the CPU tests, on CUDA. Skipped without a GPU.

    pytest -m gpu                 # or scripts/gpu_suite.sh, which also writes gpu_report.md

Run in file order: the engine (fp32 exactness against transformers, CUDA-graph replay against eager,
on cuda:0 and on cuda:1 when present), a trainer step with fused AdamW, five steps of
``async_rl_loop`` with the server on its own device, weight sync over NCCL between two GPUs, and the
vLLM adapter on a CUDA vLLM (when installed beside this package). ``tests/conftest.py`` leaves CUDA
visible only when the run selects the ``gpu`` tests alone.
"""

from __future__ import annotations

import asyncio
import importlib.util

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.deployment.engine.test_engine import PROMPTS, greedy, hf_logprobs, row_tables, run_engine
from tests.recipes.test_recipes import ROWS, Recorder
from tests.recipes.test_recipes import config as recipe_config
from tests.trainer.test_trainer import _mask_loss, _sequences
from tests.deployment.test_weight_sync_distributed import greedy as server_greedy
from tests.deployment.test_weight_sync_distributed import hf_model, max_logprob_error, perturbed
from training.deployment.client import DeploymentSampler
from training.utils import DeployConfig, EngineConfig, LossConfig, TrainerConfig
from training.utils.metrics import read_metrics

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run with: pytest -m gpu)"),
]

NUM_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
DEVICES = ["cuda:0", pytest.param("cuda:1", marks=pytest.mark.skipif(NUM_GPUS < 2, reason="needs a second GPU"))]
two_gpus = pytest.mark.skipif(NUM_GPUS < 2, reason="needs 2 CUDA GPUs")


def server_device() -> str:
    """The replica's device next to a trainer on cuda:0: the second GPU, else the CPU (no colocation)."""
    return "cuda:1" if NUM_GPUS >= 2 else "cpu"


# ----------------------------------------------------------------------- engine
@pytest.mark.parametrize("device", DEVICES)
def test_engine_fp32_on_gpu_matches_transformers(tiny_model_path, device):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()

    async def body(eng):
        return await asyncio.gather(*[eng.generate(p, greedy(16)) for p in PROMPTS])

    results = run_engine(tiny_model_path, body, device=device, dtype="float32")
    for prompt, res in zip(PROMPTS, results):
        ref = model.generate(
            torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert res.output_token_ids == ref
        assert torch.allclose(torch.tensor(res.output_logprobs), hf_logprobs(model, prompt, ref), atol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_graph_replay_equals_eager_decode(tiny_model_path, device):
    """Through the engine (its thread sets its device, so graphs on cuda:N capture on cuda:N): the
    same greedy tokens and logprobs with graphs as without, and graphs were captured and replayed."""
    captured = {}

    async def body(eng):
        out = await asyncio.gather(*[eng.generate(p, greedy(16)) for p in PROMPTS])
        graphs = eng.engine.runner.graphs
        captured[device if graphs is not None else "eager"] = len(graphs.graphs) if graphs is not None else 0
        return out

    kw = dict(device=device, dtype="float32")
    with_graphs = run_engine(tiny_model_path, body, **kw)
    eager = run_engine(tiny_model_path, body, cuda_graph_batch_sizes=(), **kw)
    assert captured[device] > 0 and captured["eager"] == 0
    for g, e in zip(with_graphs, eager):
        assert g.output_token_ids == e.output_token_ids
        assert torch.allclose(torch.tensor(g.output_logprobs), torch.tensor(e.output_logprobs), atol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_captured_graph_logits_equal_the_eager_step(tiny_model_path, device):
    """One decode step replayed from a graph gives the eager logits (a graph captured on the wrong
    device would replay nothing and leave its output stale)."""
    from training.deployment.engine.runners.cuda_graphs import CudaGraphDecoder
    from training.deployment.engine.engine import LLMEngine
    from training.deployment.engine.runners.lean import PrefillItem

    with torch.cuda.device(torch.device(device)):
        eng = LLMEngine(
            EngineConfig(
                model=tiny_model_path,
                max_batch_size=6,
                max_model_len=300,
                device=device,
                dtype="float32",
                cuda_graph_batch_sizes=(),  # runner.decode below stays eager
            )
        )
        runner = eng.runner
        tables = row_tables(runner, [1, 4, 2], 64)
        runner.prefill([PrefillItem(t, p, 0) for t, p in zip(tables, (PROMPTS[0], PROMPTS[2], PROMPTS[3]))])
        tokens = [9, 10, 11]
        positions = [len(PROMPTS[0]), len(PROMPTS[2]), len(PROMPTS[3])]
        graphs = CudaGraphDecoder(runner, (1, 2, 4, 8), max_batch_size=6, max_model_len=300)
        replayed = graphs.run(tables, tokens, positions).clone()
        eager = runner.decode(tables, tokens, positions)
    assert graphs.graphs and replayed.device == torch.device(device)
    assert torch.allclose(replayed, eager, atol=1e-5)


# ----------------------------------------------------------------------- trainer
def test_trainer_step_with_fused_adamw_raises_the_preferred_logprob(tiny_model_path):
    from training.trainer import PolicyTrainer

    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cuda:0", learning_rate=1e-2))
    assert trainer.optimizer.defaults["fused"] is True
    sequences = _sequences([20, 24])
    masks = [[0] * 8 + [1] * 12, [0] * 24]
    loss_fn = _mask_loss(masks, total_tokens=12)

    def preferred_mean():
        return sum(lp * m for lp, m in zip(trainer.logprobs(sequences)[0], masks[0])) / 12

    before = preferred_mean()
    for _ in range(4):
        trainer.forward_backward(sequences, loss_fn)
        stats = trainer.optim_step()
        assert stats["grad_norm"] > 0 and stats["gpu_memory_peak_gb"] > 0
    assert preferred_mean() > before + 0.5


# ----------------------------------------------------------------------- the recipe
def test_async_rl_loop_five_steps_on_gpu(tiny_model_path, tmp_path):
    """Trainer on cuda:0, the launched server on its own device: KL to the reference is 0 at step 0,
    the served weight version advances, the trainer's GPU memory is reported every step."""
    from training.recipes import async_rl_loop

    deployment = DeployConfig(replica_devices=[server_device()], engine_config=EngineConfig(max_batch_size=16))
    cfg = recipe_config(
        tiny_model_path,
        None,
        tmp_path,
        max_steps=5,
        deployment=deployment,
        trainer=TrainerConfig(learning_rate=1e-3, device="cuda:0"),
        loss=LossConfig(kl_beta=0.01),
    )
    out = async_rl_loop.main(cfg, rollout_fn_factory=Recorder(), rows=ROWS)
    assert out["steps"] == 5
    rows = [r for r in read_metrics(cfg.log_path) if "train/loss" in r]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert abs(rows[0]["train/kl_ref"]) < 1e-3  # policy == reference before the first update
    versions = [r["offpolicy/weight_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > versions[0]
    assert all(r["perf/gpu_memory_peak_gb"] > 0 for r in rows)


# ----------------------------------------------------------------------- weight sync over NCCL
@two_gpus
def test_weight_sync_over_nccl_from_cuda0_to_a_server_on_cuda1(tiny_model_path, tmp_path):
    from training.deployment.weights.distributed import DistributedWeightSender
    from training.deployment.backends.embedded import EmbeddedDeployment

    cfg = DeployConfig(
        api_key="dist-key",
        replica_devices=["cuda:1"],
        engine_config=EngineConfig(max_model_len=512, max_batch_size=8, dtype="float32"),
        log_file=str(tmp_path / "server.log"),
    )
    with EmbeddedDeployment(tiny_model_path, cfg, served_model_name="tiny") as dep:
        before, version = server_greedy(dep.base_url)
        assert version == 0
        new = perturbed(tiny_model_path, seed=1)
        model = hf_model(tiny_model_path, new)
        on_gpu = [(k, v.to("cuda:0")) for k, v in model.state_dict().items()]
        torch.cuda.set_device(0)
        sender = DistributedWeightSender([dep.base_url], "127.0.0.1", 0, backend="nccl", api_key="dist-key")
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(sender.connect())
            out = loop.run_until_complete(sender.push(on_gpu, 1))
        finally:
            sender.close()
            loop.close()
        assert out["servers"][dep.base_url]["weight_version"] == 1
        after, version = server_greedy(dep.base_url)
        assert version == 1 and after != before
        assert max_logprob_error(model, dep.base_url) < 1e-4


@two_gpus
def test_bucketed_nccl_sync_casts_fp32_to_a_bf16_server(tiny_model_path, tmp_path):
    """fp32 weights on cuda:0, a bf16 server on cuda:1: bf16 bytes in several buckets, one host sync."""
    from training.deployment.weights.distributed import DistributedWeightSender
    from training.deployment.backends.embedded import EmbeddedDeployment

    cfg = DeployConfig(
        api_key="dist-key",
        replica_devices=["cuda:1"],
        engine_config=EngineConfig(max_model_len=512, max_batch_size=8, dtype="bfloat16"),
        log_file=str(tmp_path / "server.log"),
    )
    with EmbeddedDeployment(tiny_model_path, cfg, served_model_name="tiny") as dep:
        assert dep.weight_dtype() == "bfloat16"
        new = perturbed(tiny_model_path, seed=2)
        on_gpu = [(k, v.to("cuda:0")) for k, v in new.items()]
        torch.cuda.set_device(0)
        sender = DistributedWeightSender(
            [dep.base_url], "127.0.0.1", 0, backend="nccl", api_key="dist-key", bucket_bytes=30_000
        )
        loop = asyncio.new_event_loop()
        try:
            out = loop.run_until_complete(sender.push(on_gpu, 1, dtype=torch.bfloat16))
        finally:
            sender.close()
            loop.close()
        answer = out["servers"][dep.base_url]
        assert answer["weight_version"] == 1 and out["num_buckets"] > 2
        assert answer["received_bytes"] == out["bytes"] == sum(t.numel() * 2 for t in new.values())
        assert server_greedy(dep.base_url)[1] == 1


# ----------------------------------------------------------------------- vLLM on CUDA
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="no CUDA vLLM installed beside this package")
def test_vllm_on_cuda_samples_like_transformers_and_reloads_weights(tmp_path):
    from tests.deployment.test_vllm import PROMPT, _perturb, hf_logprobs, max_diff, saved_weights
    from training.deployment.backends.vllm import VLLMDeployment
    from training.models.build_tiny import build_tiny, cache_dir

    path = cache_dir() / "tiny-qwen3-h128"
    if not (path / "config.json").exists():
        build_tiny(path, hidden=128)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = DeployConfig(
        engine="vllm",
        replica_devices=[f"cuda:{NUM_GPUS - 1}"],
        gpu_memory_fraction=0.3,
        startup_timeout_s=600,
        engine_config=EngineConfig(max_model_len=512, max_batch_size=16, dtype="float32"),
    )
    with VLLMDeployment(str(path), cfg, log_file=str(tmp_path / "vllm.log")) as dep:
        assert "--enforce-eager" not in dep._command()

        async def sample(version: int):
            s = DeploymentSampler(dep.base_url)
            s.note_weight_version(version)
            try:
                return await s.sample_with_prompt_tokens(
                    PROMPT, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True
                )
            finally:
                await s.close()

        (c,) = asyncio.run(sample(0))
        assert max_diff(c.inference_logprobs, hf_logprobs(hf, c.full_tokens, c.prompt_len)) < 1e-3
        _perturb(hf, 0.5, ["model."])
        asyncio.run(dep.push_weights(saved_weights(hf), 1, mode="disk", directory=str(tmp_path / "w1")))
        (c,) = asyncio.run(sample(1))
        assert c.weight_version == 1
        assert max_diff(c.inference_logprobs, hf_logprobs(hf, c.full_tokens, c.prompt_len)) < 1e-3
