"""LoRA in the trainer: adapters train, merged weights leave it, checkpoints resume, export loads."""

import asyncio

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

from training.trainer import PolicyTrainer, ReferenceModel
from training.utils.checkpoint import load_checkpoint, save_checkpoint
from training.utils.config import TrainerConfig

pytest.importorskip("peft", reason="needs the 'lora' extra (scripts/setup.sh installs it; setup_floor.sh does not)")

SEQS = [[1, 9, 23, 57, 80 + i, 91, 14 + 3 * i, 200 + i, 33, 7 + i][: 6 + i] for i in range(4)]
MASKS = [[0] * 3 + [1] * (len(s) - 3) for s in SEQS]
TRAINED = sum(map(sum, MASKS))


def _lora(path, **kw):
    cfg = dict(device="cpu", learning_rate=2e-2, lora_rank=4, lora_alpha=8.0)
    cfg.update(kw)
    return PolicyTrainer(path, TrainerConfig(**cfg))


def _loss(packed, logprobs_N):
    mask_N = packed.gather(MASKS)
    return -(mask_N * logprobs_N).sum() / TRAINED, {}


def _train(trainer, steps):
    losses = []
    for _ in range(steps):
        losses.append(trainer.forward_backward(SEQS, _loss)["loss"])
        trainer.optim_step()
    return losses


def _max_diff(a, b):
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def test_lora_trains_only_the_adapters_and_the_loss_goes_down(tiny_model_path):
    trainer = _lora(tiny_model_path)
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert any("mlp.down_proj" in n for n in trainable) and any("self_attn.q_proj" in n for n in trainable)
    assert not any("lm_head" in n or "embed" in n for n in trainable), "all-linear leaves the LM head out"
    frozen = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    start = trainer.logprobs(SEQS)
    assert start == PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu")).logprobs(SEQS), "B = 0 at start"
    losses = _train(trainer, 6)
    assert losses[-1] < losses[0] - 0.5, losses
    for n, p in trainer.model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), n


def test_named_weights_are_the_base_weights_merged_by_hand(tiny_model_path):
    trainer = _lora(tiny_model_path)
    _train(trainer, 2)
    full = dict(PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu")).named_weights())
    weights = dict(trainer.named_weights())
    assert set(weights) == set(full), "the base model's names, adapters left out"
    params = dict(trainer.model.named_parameters())
    scale = 8.0 / 4
    merged_any = False
    for name, tensor in weights.items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.lora_A.default.weight" in params:
            a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
            expected = params[f"{module}.base_layer.weight"] + scale * b @ a
            assert b.abs().max() > 0, name
            merged_any = True
        else:
            expected = params[name]
        torch.testing.assert_close(tensor, expected.detach(), atol=1e-6, rtol=1e-6)
    assert merged_any
    assert trainer.weight_specs() == [(n, t.dtype, tuple(t.shape)) for n, t in trainer.named_weights()]


def test_lora_checkpoint_resumes_with_equal_adapters_and_optimizer_state(tiny_model_path, tmp_path):
    trainer = _lora(tiny_model_path)
    _train(trainer, 2)
    path = save_checkpoint(tmp_path, 2, trainer.model, trainer.optimizer, {"step": 2})
    stored = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    model_keys = {k.split(".", 1)[1] for k in stored if k.startswith("model.")}
    assert model_keys == {n for n, p in trainer.model.named_parameters() if p.requires_grad}, (
        "the adapters, not the frozen base weights"
    )
    resumed = _lora(tiny_model_path, seed=7)  # other random A: everything must come from the checkpoint
    assert load_checkpoint(path, resumed.model, resumed.optimizer) == {"step": 2}
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n
    ours, theirs = trainer.optimizer.state_dict(), resumed.optimizer.state_dict()
    assert ours["state"].keys() == theirs["state"].keys() and len(ours["state"]) > 0
    for k, state in ours["state"].items():
        for key, value in state.items():
            assert torch.equal(value, theirs["state"][k][key]), (k, key)
    _train(trainer, 1)
    _train(resumed, 1)
    for (n, p), (_, q) in zip(trainer.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(p, q), n


def test_export_loads_with_from_pretrained_and_scores_like_the_trainer(tiny_model_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    trainer = _lora(tiny_model_path)
    _train(trainer, 3)
    out = trainer.save_pretrained(tmp_path / "export", adapters=True)
    assert not any("lora" in k or "base_layer" in k for k in load_file(str(out / "model.safetensors")))
    expected = trainer.logprobs(SEQS)
    base = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu")).logprobs(SEQS)
    assert _max_diff(expected, base) > 1e-2, "training moved the policy"

    def score(model):
        with torch.no_grad():
            result = []
            for seq in SEQS:
                logp = model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
                result.append([0.0] + logp[:-1].gather(-1, torch.tensor(seq[1:])[:, None])[:, 0].tolist())
            return result

    merged = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert _max_diff(score(merged), expected) < 1e-5
    with_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_path), out / "adapter")
    assert _max_diff(score(with_adapter.eval()), expected) < 1e-5


def test_base_reference_is_the_untrained_model_and_leaves_the_adapters_on(tiny_model_path):
    trainer = _lora(tiny_model_path)
    _train(trainer, 2)
    trained = trainer.logprobs(SEQS)
    reference = trainer.base_reference()
    assert reference.logprobs(SEQS) == ReferenceModel(tiny_model_path, TrainerConfig(device="cpu")).logprobs(SEQS)
    assert trainer.logprobs(SEQS) == trained
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if ".lora_" in n)
    with pytest.raises(ValueError, match="lora_rank"):
        PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu")).base_reference()


def test_base_reference_shares_the_policys_thread_budget_and_layer_hooks(tiny_model_path):
    """The base reference is the policy's model: sharing the CPU with both (as the recipe does, reference made
    first) installs one set of layer hooks, and both ask the same budget."""
    from training.trainer.model import decoder_layers

    trainer = _lora(tiny_model_path)
    reference = trainer.base_reference()
    layers = decoder_layers(trainer.model)
    hooks_before = [len(layer._forward_pre_hooks) for layer in layers]
    asked = []

    def budget():
        asked.append(None)
        return torch.get_num_threads()

    trainer.share_cpu(budget)
    reference.share_cpu(budget)
    assert [len(layer._forward_pre_hooks) for layer in layers] == [n + 1 for n in hooks_before]
    assert reference.thread_budget is trainer.thread_budget is budget
    reference.logprobs(SEQS)
    assert len(asked) == len(layers) + 1  # the entry point, then each layer once


def test_bad_lora_settings_name_the_field(tiny_model_path):
    with pytest.raises(ValueError, match="lora_target_modules"):
        _lora(tiny_model_path, lora_target_modules=["no_such_proj"])
    with pytest.raises(ValueError, match="lora_target_modules"):
        _lora(tiny_model_path, lora_target_modules=["embed_tokens"])
    for field, value in (("lora_rank", -1), ("lora_alpha", 0.0), ("lora_dropout", 1.0), ("lora_target_modules", [])):
        with pytest.raises(ValueError, match=field):
            TrainerConfig(**{field: value})


def test_merged_weights_reach_the_embedded_server_which_needs_no_adapter_support(embedded_server, tiny_model_path):
    """Pushed with the ordinary weight sync, the merged weights make the server score what the trainer scores."""
    from training.deployment.client import DeploymentSampler

    trainer = _lora(tiny_model_path)
    _train(trainer, 3)
    prompt = SEQS[0][:4]
    with embedded_server(fresh=True, max_batch_size=4, max_model_len=64) as dep:  # fresh: the test pushes weights

        async def sample():
            sampler = DeploymentSampler([dep.base_url])
            try:
                (c,) = await sampler.sample_with_prompt_tokens(prompt, n=1, max_tokens=6, temperature=1.0)
                return c
            finally:
                await sampler.close()

        before = asyncio.run(sample())
        asyncio.run(dep.push_weights(trainer.named_weights(), 1))
        after = asyncio.run(sample())
    for completion, scorer in ((before, PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu"))), (after, trainer)):
        got = scorer.logprobs([completion.full_tokens])[0][completion.prompt_len :]
        assert max(abs(a - b) for a, b in zip(got, completion.inference_logprobs)) < 1e-4
    assert after.weight_version == 1
    moved = trainer.logprobs([before.full_tokens])[0][before.prompt_len :]
    assert max(abs(a - b) for a, b in zip(moved, before.inference_logprobs)) > 1e-3, "the push changed the policy"


def test_a_bf16_compute_run_holds_the_frozen_base_in_bf16_and_trains_fp32_adapters(tiny_model_path):
    """The CUDA default (compute in bf16) on the CPU's opt-in path: the base has no fp32 master copy (half the bytes),
    the adapters stay fp32 (bf16 adapters would round small updates away), and the merged export is W + s·BA."""
    trainer = _lora(tiny_model_path, compute_dtype="bfloat16")
    base = {n: p for n, p in trainer.model.named_parameters() if not p.requires_grad}
    adapters = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert base and all(p.dtype == torch.bfloat16 for p in base.values())
    assert adapters and all(p.dtype == torch.float32 for p in adapters.values())
    frozen = {n: p.detach().clone() for n, p in base.items()}
    losses = _train(trainer, 6)
    assert losses[-1] < losses[0] - 0.5, losses
    assert all(torch.equal(p, frozen[n]) for n, p in base.items())
    params = dict(trainer.model.named_parameters())
    for name, tensor in trainer.named_weights():
        module = name.rsplit(".", 1)[0]
        if f"{module}.lora_A.default.weight" in params:
            a, b = params[f"{module}.lora_A.default.weight"], params[f"{module}.lora_B.default.weight"]
            expected = (params[f"{module}.base_layer.weight"].float() + 2.0 * b @ a).to(torch.bfloat16)
            assert tensor.dtype == torch.bfloat16
            torch.testing.assert_close(tensor, expected.detach(), atol=0, rtol=0)
    # trainer.dtype set: the base follows it (the fp32 master-copy path a user asks for)
    assert all(
        p.dtype == torch.float32
        for p in _lora(tiny_model_path, compute_dtype="bfloat16", dtype="float32").model.parameters()
    )
