"""The critic on the tiny model (``training/trainer/value_head.py``): values aligned like the logprobs under every
packing, the value loss trains the head alone, the PPO step with ``advantage="gae"`` lowers the value loss, and a
run resumed from a checkpoint ends with the same policy and value head as one never stopped, bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from training.trainer import PolicyTrainer
from training.utils.checkpoint import load_checkpoint, save_checkpoint
from training.utils.config import TrainerConfig
from training.utils.rl.critic_config import CriticConfig
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.ppo import StepBatch, train_on_batch

PROMPT = [5, 17, 42, 99, 7]


def _batch(seed: int = 0) -> StepBatch:
    rng = random.Random(seed)
    completions = [[rng.randrange(300) for _ in range(n)] for n in (4, 6, 3, 5)]
    tokens = [PROMPT + c for c in completions]
    return StepBatch(
        tokens=tokens,
        sampler_logprobs=[[0.0] * len(t) for t in tokens],
        loss_masks=[[0] * len(PROMPT) + [1] * len(c) for c in completions],
        advantages=[1.0, 0.0, 1.0, 0.0],  # under gae: the returns
        weights=[1.0] * 4,
    )


def _trainer(tiny_model_path, **kw) -> PolicyTrainer:
    trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3, **kw))
    trainer.attach_critic(CriticConfig(learning_rate=1e-2))
    return trainer


@pytest.mark.parametrize("shared", [True, False])
def test_values_are_read_from_the_hidden_state_that_predicts_each_token(tiny_model_path, shared):
    trainer = _trainer(tiny_model_path, shared_prompt_packing=shared)
    torch.manual_seed(1)
    torch.nn.init.normal_(trainer.critic.head.weight, std=0.5)
    tokens = _batch().tokens
    logprobs, values = trainer.logprobs_and_values(tokens)
    assert logprobs == trainer.logprobs(tokens)
    decoder, head = trainer.model.get_decoder(), trainer.critic.head
    with torch.no_grad():
        for seq, got in zip(tokens, values):
            hidden = decoder(input_ids=torch.tensor([seq])).last_hidden_state[0]
            expected = [0.0] + head(hidden[:-1]).squeeze(-1).tolist()
            assert got == pytest.approx(expected, abs=1e-5)
    assert any(abs(v) > 1e-3 for v in values[0][1:])  # the head is not zero: the check can fail


def test_the_value_loss_trains_the_head_alone(tiny_model_path):
    trainer = _trainer(tiny_model_path)

    def loss_fn(packed, logprobs_N, values_N):
        return ((values_N - 1.0) ** 2).sum() + 0.0 * logprobs_N.sum(), {}

    trainer.forward_backward(_batch().tokens, loss_fn, with_values=True)
    assert trainer.critic.head.weight.grad is not None and trainer.critic.head.bias.grad.abs().item() > 0
    assert all(p.grad is None or not p.grad.any() for p in trainer.model.parameters())
    with pytest.raises(ValueError, match="with_values needs a critic"):
        PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu")).forward_backward(
            _batch().tokens, loss_fn, with_values=True
        )


def test_a_gae_step_lowers_the_value_loss_and_logs_the_critic(tiny_model_path):
    trainer = _trainer(tiny_model_path)
    losses = []
    for _ in range(4):
        metrics = train_on_batch(trainer, _batch(), LossConfig(kl_beta=0.0))
        losses.append(metrics["train/value_loss"])
    # V = 0 at the start: L^V = 0.5·R^2 per token; R = 1 on the 4 + 3 tokens of samples 0 and 2, of 18
    assert losses[0] == pytest.approx(0.5 * 7 / 18, rel=1e-6)
    assert losses[-1] < 0.8 * losses[0], losses
    for key in ("train/value_grad_norm", "train/value_clip_fraction", "train/value_explained_variance"):
        assert key in metrics
    assert metrics["train/advantage_mean"] == pytest.approx(0.0, abs=1e-6)  # whitened over the step


def _state(trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    out.update({f"head.{k}": v.clone() for k, v in trainer.critic.head.state_dict().items()})
    return out


def test_a_resumed_critic_run_equals_an_uninterrupted_one_bit_for_bit(tiny_model_path, tmp_path):
    """Four PPO steps (two mini-batches each, so V_old clipping acts) straight, against two, a checkpoint, and two
    more in a fresh trainer that loaded it: same policy weights, same value head."""
    loss_cfg = LossConfig(kl_beta=0.0)

    def steps(trainer, first, last):
        for step in range(first, last):
            train_on_batch(trainer, _batch(step), loss_cfg, ppo_mini_batches=2, seed=step)

    straight = _trainer(tiny_model_path)
    steps(straight, 0, 4)

    first = _trainer(tiny_model_path)
    steps(first, 0, 2)
    save_checkpoint(tmp_path, 2, first.model, first.optimizer, {"step": 2}, critic=first.critic)
    resumed = _trainer(tiny_model_path)
    assert load_checkpoint(tmp_path / "step_000002", resumed.model, resumed.optimizer, resumed.critic) == {"step": 2}
    assert torch.equal(resumed.critic.head.weight, first.critic.head.weight)
    assert resumed.critic.head.weight.abs().sum() > 0  # the head trained before the checkpoint
    steps(resumed, 2, 4)

    a, b = _state(straight), _state(resumed)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ


def test_the_memory_plan_counts_the_critics_bytes(tiny_model_path):
    from training.recipes.async_rl_loop import Config
    from training.recipes.memory_plan import GB, plan_memory

    trainer = _trainer(tiny_model_path)
    train_on_batch(trainer, _batch(), LossConfig(kl_beta=0.0))
    head = trainer.critic
    params = sum(p.numel() * p.element_size() for p in head.head.parameters())
    moments = sum(
        v.numel() * v.element_size() for s in head.optimizer.state.values() for k, v in s.items() if k != "step"
    )
    measured = 2 * params + moments  # weights, gradients (freed after the step, held during it), two moments
    assert head.num_bytes() == measured

    def parts(**kw):
        cfg = Config(base_model=tiny_model_path, trainer=TrainerConfig(device="cpu"), **kw)
        return {p.name: p.host_bytes for p in plan_memory(cfg, gpus_per_node=0, host_bytes=24 * GB).parts}

    assert parts(advantage="gae")["critic"] == measured
    assert "critic" not in parts()
