"""The trainer's numerics choices: bf16 autocast (``TrainerConfig.compute_dtype``) with fp32 master weights, and
torch's fused AdamW, kept across checkpoints written without it."""

import copy

import pytest
import torch

from training.recipes.async_rl_loop import Config
from training.trainer import PolicyTrainer
from training.trainer.model import packed_sdpa_attention
from training.utils.checkpoint import load_checkpoint, save_checkpoint
from training.utils.cli import apply_overrides
from training.utils.config import TrainerConfig

PROMPT = [7, 3, 9, 1, 4, 4, 8, 2, 6]
SEQUENCES = [PROMPT + [11, 12, 13, 14], PROMPT + [21, 22], [5, 6, 7, 8, 9, 10, 40, 41], PROMPT + [31, 32, 33]]
BF16_MAX_LOGPROB_GAP = 0.05
"""bf16 autocast vs fp32 on the tiny model: the largest |Δ logprob| allowed (measured: about 0.01)."""


def _nll(sequences):
    total = sum(len(s) - 1 for s in sequences)
    return lambda packed, logprobs_N: (-logprobs_N.sum() / total, {})


def _flat_grad(model):
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def test_bf16_autocast_trains_fp32_master_weights_close_to_fp32(tiny_model_path):
    fp32 = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3))
    bf16 = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3, compute_dtype="bfloat16"))
    assert bf16.dtype == torch.float32 and bf16.compute_dtype == torch.bfloat16 and bf16.share_prefixes

    seen = {}

    def keep(packed, logprobs_N):
        assert logprobs_N.dtype == torch.float32  # the log-softmax runs in fp32
        for i, lp in zip(packed.sample_indices, packed.split(logprobs_N.detach())):
            seen[i] = lp.tolist()
        return _nll(SEQUENCES)(packed, logprobs_N)

    loss32 = fp32.forward_backward(SEQUENCES, _nll(SEQUENCES))["loss"]
    loss16 = bf16.forward_backward(SEQUENCES, keep)["loss"]
    assert abs(loss16 - loss32) < BF16_MAX_LOGPROB_GAP
    g32, g16 = _flat_grad(fp32.model), _flat_grad(bf16.model)
    assert g16.dtype == torch.float32 and torch.isfinite(g16).all()
    assert torch.nn.functional.cosine_similarity(g16, g32, dim=0) > 0.99

    scored = bf16.logprobs(SEQUENCES)  # no gradient, eval mode: the same numbers as with gradient (ratio 1)
    assert [scored[i] for i in range(len(SEQUENCES))] == [seen[i] for i in range(len(SEQUENCES))]
    reference = fp32.logprobs(SEQUENCES)
    gap = max(abs(a - b) for s, r in zip(scored, reference) for a, b in zip(s, r))
    assert 0 < gap < BF16_MAX_LOGPROB_GAP

    before = [p.detach().clone() for p in bf16.model.parameters()]
    bf16.optim_step()
    after = list(bf16.model.parameters())
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_bf16_autocast_is_one_override_of_the_recipe_config():
    cfg = apply_overrides(Config(base_model="m"), ["trainer.compute_dtype=bfloat16"])
    assert cfg.trainer.compute_dtype == "bfloat16"
    assert Config(base_model="m").trainer.compute_dtype == "auto"  # default: fp32 on CPU


def test_cpu_attention_runs_bf16_inputs_in_fp32():
    """torch's CPU attention kernels are several times slower in bf16: ``packed_sdpa`` upcasts them, autocast or not."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    module = torch.nn.Module()
    want, _ = packed_sdpa_attention(module, q, k, v, None, cu_seq_lens_q=cu)
    got, _ = packed_sdpa_attention(module, q.bfloat16(), k.bfloat16(), v.bfloat16(), None, cu_seq_lens_q=cu)
    assert got.dtype == torch.bfloat16
    exact, _ = packed_sdpa_attention(
        module, q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), None, cu_seq_lens_q=cu
    )
    assert torch.equal(got, exact.bfloat16())  # fp32 arithmetic on the bf16 values, rounded once at the end
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed, _ = packed_sdpa_attention(module, q, k, v.bfloat16(), None, cu_seq_lens_q=cu)
    assert mixed.dtype == torch.bfloat16
    torch.testing.assert_close(mixed.float(), want, atol=2e-2, rtol=0)


def _plain_adamw_step(trainer, grads):
    """One AdamW step with torch's per-tensor loop on copies of the trainer's parameters and state."""
    params = [p.detach().clone().requires_grad_() for p in trainer.model.parameters()]
    groups, index = [], {id(p): i for i, p in enumerate(trainer.model.parameters())}
    for group in trainer.optimizer.param_groups:
        groups.append(
            {
                **{k: v for k, v in group.items() if k != "params"},
                "params": [params[index[id(p)]] for p in group["params"]],
            }
        )
        groups[-1].update(fused=None, foreach=False)
    plain = torch.optim.AdamW(groups)
    state = copy.deepcopy(trainer.optimizer.state_dict())  # load_state_dict would share the moments' storage
    plain.load_state_dict({**state, "param_groups": plain.state_dict()["param_groups"]})
    for p, g in zip(params, grads):
        p.grad = g.clone()
    plain.step()
    return params


def test_adamw_is_fused_even_after_loading_a_checkpoint_written_without_it(tiny_model_path, tmp_path):
    writer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3))
    for group in writer.optimizer.param_groups:  # as an optimizer built before the fused kernel was chosen
        group["fused"], group["foreach"] = None, False
    writer.forward_backward(SEQUENCES, _nll(SEQUENCES))
    writer.optimizer.step()
    writer.optimizer.zero_grad(set_to_none=True)
    path = save_checkpoint(tmp_path, 1, writer.model, writer.optimizer, {"step": 1})

    reader = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3))
    load_checkpoint(path, reader.model, reader.optimizer)
    assert all(g["fused"] is None for g in reader.optimizer.param_groups)  # the writer's flag came back with the state
    reader.forward_backward(SEQUENCES, _nll(SEQUENCES))
    grads = [p.grad.clone() for p in reader.model.parameters()]
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    grads = [g * min(1.0, reader.cfg.grad_clip_norm / (float(norm) + 1e-6)) for g in grads]  # optim_step clips first
    expected = _plain_adamw_step(reader, grads)
    reader.optim_step()
    assert all(g["fused"] is True for g in reader.optimizer.param_groups)
    for got, want in zip(reader.model.parameters(), expected):
        torch.testing.assert_close(got.detach(), want.detach(), atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("field", ["compute_dtype"])
def test_bad_compute_dtype_names_the_field(field):
    with pytest.raises(ValueError, match=field):
        TrainerConfig(**{field: "bf16"})
