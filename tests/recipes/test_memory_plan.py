"""The memory plan (``training/recipes/memory_plan.py``) against bytes measured on real models, and its verdicts."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from training.recipes.async_rl_loop import Config
from training.recipes.memory_plan import GB, ModelShape, plan_memory
from training.utils import LossConfig, TrainerConfig
from training.utils.config import DeployConfig

ROOT = Path(__file__).resolve().parents[2]


def _smollm2_path() -> str:
    from training.models.smollm2 import ensure_smollm2

    try:
        return ensure_smollm2()
    except Exception as exc:  # the wheel or the conversion packages missing
        pytest.skip(f"SmolLM2 not available: {exc}")


def _saved_activation_bytes(trainer, tokens: int) -> int:
    """Bytes of the tensors the decoder keeps for backward on one packed sequence (parameters excluded)."""
    from training.trainer.packing import pack_sequences

    packed = pack_sequences([list(range(5, 5 + tokens))], tokens)[0]
    storages: dict[int, int] = {}

    def keep(x):
        s = x.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return x

    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda x: x):
        trainer.model.get_decoder()(
            input_ids=packed.input_ids_N[None], position_ids=packed.position_ids_N[None], use_cache=False
        )
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama", "smollm2"])
def test_activation_bytes_are_within_15_percent_of_what_the_decoder_keeps(model, tiny_model_path, tiny_llama_path):
    from training.trainer import PolicyTrainer

    path = {"tiny-qwen3": tiny_model_path, "tiny-llama": tiny_llama_path}.get(model) or _smollm2_path()
    tokens = 256
    trainer = PolicyTrainer(path, TrainerConfig(device="cpu", micro_batch_tokens=tokens, shared_prompt_packing=False))
    shape = ModelShape.of(path)
    assert shape.params == sum(p.numel() for p in trainer.model.parameters())
    planned = tokens * shape.layers * shape.activation_bytes_per_token_layer(4)
    measured = _saved_activation_bytes(trainer, tokens)
    assert abs(planned - measured) <= 0.15 * measured, (planned, measured)


def test_weights_gradients_and_optimizer_are_the_trainers_bytes(tiny_model_path):
    from training.trainer import PolicyTrainer

    cfg = Config(base_model=tiny_model_path, trainer=TrainerConfig(device="cpu"), loss=LossConfig(kl_beta=0.05))
    trainer = PolicyTrainer(tiny_model_path, cfg.trainer)
    trainer.forward_backward([[1, 5, 7, 9]], lambda packed, lp: (-lp.sum(), {}))
    trainer.optim_step()
    weights = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trainer.model.parameters() if p.grad is not None)
    optimizer = sum(
        v.numel() * v.element_size()
        for state in trainer.optimizer.state.values()
        for k, v in state.items()
        if k in ("exp_avg", "exp_avg_sq")
    )
    plan = plan_memory(cfg, gpus_per_node=0, host_bytes=24 * GB)
    parts = {p.name: p.host_bytes for p in plan.parts}
    assert parts["policy weights"] == weights
    assert parts["gradients"] == grads or grads == 0  # the step may have zeroed them
    assert parts["optimizer"] == optimizer
    assert parts["reference"] == weights  # fp32 on CPU
    assert not plan.problems()


def _qwen3_8b_shape(tmp_path) -> str:
    from transformers import Qwen3Config

    folder = tmp_path / "qwen3-8b-shaped"
    Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    return str(folder)


def test_qwen3_8b_full_fine_tuning_fits_one_node_of_8x80gb_and_not_one_gpu(tmp_path, tiny_model_path):
    """(It builds a model, on ``meta``: the ``tiny_model_path`` fixture keeps it out of ``unit``.)"""
    folder = _qwen3_8b_shape(tmp_path)
    shape = ModelShape.of(folder)  # config.json only, built on meta
    assert 8.0e9 < shape.params < 8.4e9 and shape.qk_norm
    cfg = Config(base_model=folder, trainer=TrainerConfig(micro_batch_tokens=4096, gradient_checkpointing=True))
    plan = plan_memory(cfg, shape=shape, gpus_per_node=8, gpu_bytes=80 * GB, host_bytes=1000 * GB)
    print(plan.table())
    assert plan.trainer_gpus == 7 and plan.inference_gpus == 1
    assert not plan.problems(), plan.table()
    assert "fits" in plan.table().splitlines()[-1]
    one_gpu = plan_memory(cfg, shape=shape, gpus_per_node=1, gpu_bytes=80 * GB, host_bytes=1000 * GB)
    assert one_gpu.problems() and "LoRA" in one_gpu.problems()[0], one_gpu.table()
    no_checkpointing = Config(base_model=folder, trainer=TrainerConfig(micro_batch_tokens=16384))
    plan = plan_memory(no_checkpointing, shape=shape, gpus_per_node=8, gpu_bytes=80 * GB, host_bytes=1000 * GB)
    assert plan.problems() and "gradient_checkpointing" in plan.problems()[0], plan.table()


def test_memory_plan_command_reads_an_examples_cfg_and_its_overrides(tiny_model_path):
    example = ROOT / "training" / "examples" / "rl" / "single_turn_token_in" / "train.py"
    args = [sys.executable, "-m", "training.memory_plan", str(example), "trainer.micro_batch_tokens=512"]
    done = subprocess.run(
        [*args, "--gpus-per-node", "8", "--gpu-gb", "80"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "memory plan: full fine-tuning, 7 trainer rank(s)" in done.stdout and "512 tokens" in done.stdout
    assert done.stdout.strip().splitlines()[-1] == "fits"


def test_a_colocated_vllm_takes_its_memory_share_and_the_plan_says_what_it_leaves(tmp_path, tiny_model_path):
    """vLLM reads one memory setting, its share of the GPU: colocated at its default 0.9 with a trainer, the
    8B plan does not fit and names ``gpu_memory_fraction``; at 0.35 it fits."""
    from training.utils import DeployConfig

    folder = _qwen3_8b_shape(tmp_path)
    shape = ModelShape.of(folder)
    trainer = TrainerConfig(micro_batch_tokens=4096, gradient_checkpointing=True)
    for fraction, fits in ((None, False), (0.35, True)):
        deployment = DeployConfig(engine="vllm", colocate=True, gpu_memory_fraction=fraction)
        cfg = Config(base_model=folder, trainer=trainer, deployment=deployment)
        plan = plan_memory(cfg, shape=shape, gpus_per_node=8, gpu_bytes=80 * GB, host_bytes=1000 * GB)
        assert {p.name for p in plan.parts} >= {"engine share"} and "KV pool" not in {p.name for p in plan.parts}
        assert (not plan.problems()) == fits, plan.table()
        if not fits:
            assert "gpu_memory_fraction" in plan.problems()[0]


def test_plan_run_decides_checkpointing_from_the_plan_on_cuda_and_leaves_it_off_on_cpu(
    tmp_path, tiny_model_path, monkeypatch
):
    """(The visible GPUs are faked: this machine has none; the decision is what is tested.)"""
    from training.recipes import memory_plan

    folder = _qwen3_8b_shape(tmp_path)
    cfg = Config(base_model=folder, trainer=TrainerConfig(micro_batch_tokens=16384))
    assert cfg.trainer.gradient_checkpointing is None
    monkeypatch.setattr(memory_plan, "_visible_gpus", lambda: (0, None))
    assert memory_plan.plan_run(cfg, folder).trainer.gradient_checkpointing is False
    monkeypatch.setattr(memory_plan, "_visible_gpus", lambda: (8, 80 * GB))
    assert memory_plan.plan_run(cfg, folder).trainer.gradient_checkpointing is True  # 16k tokens need it
    small = Config(base_model=folder, trainer=TrainerConfig(micro_batch_tokens=1024))
    assert memory_plan.plan_run(small, folder).trainer.gradient_checkpointing is False
    from training.utils import ConfigError

    monkeypatch.setattr(memory_plan, "_visible_gpus", lambda: (1, 80 * GB))
    with pytest.raises(ConfigError, match="memory plan: .*LoRA"):
        memory_plan.plan_run(cfg, folder)


def test_a_colocated_vllm_left_at_its_default_share_gets_what_the_trainer_leaves(
    tmp_path, tiny_model_path, monkeypatch
):
    """(The visible GPUs are faked: this machine has none.)"""
    from training.recipes import memory_plan
    from training.utils import DeployConfig

    folder = _qwen3_8b_shape(tmp_path)
    trainer = TrainerConfig(micro_batch_tokens=4096, gradient_checkpointing=True)
    cfg = Config(base_model=folder, trainer=trainer, deployment=DeployConfig(engine="vllm", colocate=True))
    monkeypatch.setattr(memory_plan, "_visible_gpus", lambda: (8, 80 * GB))
    decided = memory_plan.plan_run(cfg, folder)
    share = decided.deployment.gpu_memory_fraction
    assert cfg.deployment.gpu_memory_fraction is None and 0.3 < share < 0.92
    plan = plan_memory(decided, gpus_per_node=8, gpu_bytes=80 * GB, host_bytes=1000 * GB)
    assert not plan.problems() and plan.per_gpu("trainer") <= memory_plan.HEADROOM * 80 * GB
    given = Config(
        base_model=folder,
        trainer=trainer,
        deployment=DeployConfig(engine="vllm", colocate=True, gpu_memory_fraction=0.3),
    )
    assert memory_plan.plan_run(given, folder).deployment.gpu_memory_fraction == 0.3  # a given share is kept


def test_lora_on_a_gpu_holds_the_qwen3_8b_base_in_bf16_and_fits_one_gpu(tmp_path, tiny_model_path):
    """The trainer's rule (trainer.py): under LoRA the frozen base is in the compute dtype, bf16 on CUDA."""
    folder = _qwen3_8b_shape(tmp_path)
    shape = ModelShape.of(folder)
    trainer = TrainerConfig(micro_batch_tokens=4096, gradient_checkpointing=True, lora_rank=16)
    cfg = Config(base_model=folder, trainer=trainer, deployment=DeployConfig(colocate=True))
    plan = plan_memory(cfg, shape=shape, gpus_per_node=1, gpu_bytes=80 * GB, host_bytes=1000 * GB)
    [weights] = [p for p in plan.parts if p.name == "policy weights"]
    assert 2 * shape.params <= weights.gpu_bytes < 2.1 * shape.params, plan.table()
    assert not plan.problems(), plan.table()
    fp32 = replace(cfg, trainer=replace(trainer, dtype="float32"))
    [weights] = [
        p
        for p in plan_memory(fp32, shape=shape, gpus_per_node=1, gpu_bytes=80 * GB).parts
        if p.name == "policy weights"
    ]
    assert weights.gpu_bytes >= 4 * shape.params
