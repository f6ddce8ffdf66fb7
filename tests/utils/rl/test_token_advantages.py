"""Per-token advantages: a sample may carry A_t per token (``RolloutSample.token_advantages``, or what the
recipe's distillation builds); the PPO step and every loss read A per token, so it reaches the loss as is."""

from __future__ import annotations

import math

import pytest
import torch

from training.utils import LossConfig, TrainerConfig


def test_per_token_advantages_reach_the_loss(tiny_model_path):
    """One PPO step on a batch whose samples carry per-token advantages: with importance_sampling, one update and
    w = 1 (sampler = trainer logprobs) the loss is −mean over trainable tokens of A_t, and its gradient is the one
    of the scalar advantages when the lists are constant."""
    from training.trainer import PolicyTrainer
    from training.utils.rl.ppo import StepBatch, train_on_batch

    config = TrainerConfig(device="cpu", learning_rate=1e-3, micro_batch_tokens=16)
    cfg = LossConfig(policy_loss="importance_sampling", kl_beta=0.0)
    sequences = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [20, 21, 22, 23, 24]]
    masks = [[0, 0, 1, 1, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1, 1]]
    per_token = [[0.0, 0.0, 1.0, -2.0, 0.5, 3.0], [0.0, -1.0, -1.0, 4.0], [0.0, 0.0, 0.0, 2.5, -0.5]]
    trainer = PolicyTrainer(tiny_model_path, config)
    sampler = [[lp * m for lp, m in zip(lps, mask)] for lps, mask in zip(trainer.logprobs(sequences), masks)]
    got = train_on_batch(trainer, StepBatch(sequences, sampler, masks, per_token, [1.0] * 3), cfg)
    trainable = [a for adv, mask in zip(per_token, masks) for a, m in zip(adv, mask) if m]
    assert got["train/loss"] == pytest.approx(-sum(trainable) / len(trainable), rel=1e-4)

    grads = []
    for advantages in ([0.5, -1.0, 2.0], [[0.5] * 6, [-1.0] * 4, [2.0] * 5]):
        t = PolicyTrainer(tiny_model_path, config)
        train_on_batch(t, StepBatch(sequences, sampler, masks, advantages, [1.0] * 3), cfg)
        grads.append([p.detach().clone() for p in t.model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_rollout_sample_token_advantages_are_validated_and_used():
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import RolloutSample, RolloutValidationError, validate_sample

    dense = RolloutSample([1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], 1.0, token_advantages=[0.0, 0.3, -0.2])
    validate_sample(dense)
    for bad in ([0.0, 0.3], [0.0, math.inf, 1.0]):
        with pytest.raises(RolloutValidationError, match="token_advantages"):
            validate_sample(RolloutSample([1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], 1.0, token_advantages=bad))
    plain = RolloutSample([1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], 0.0)
    group = PromptGroup(0, {}, 0, samples=[dense, plain], completion_index=[0, 1], completion_rewards={0: 1.0, 1: 0.0})
    group.compute_advantages()
    assert group.advantages[0] == [0.0, 0.3, -0.2] and group.advantages[1] == pytest.approx(
        -0.5 / (math.sqrt(0.5) + 1e-4)
    )


def test_a_group_with_equal_rewards_has_signal_when_a_sample_carries_token_advantages():
    from training.utils.rl.filters import has_learning_signal
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import RolloutSample

    def group(dense: list[float]) -> PromptGroup:
        samples = [
            RolloutSample([1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], 1.0, token_advantages=dense),
            RolloutSample([1, 2, 4], [0.0, -1.0, -1.0], [0, 1, 1], 1.0),
        ]
        return PromptGroup(0, {}, 0, samples=samples, completion_index=[0, 1], completion_rewards={0: 1.0, 1: 1.0})

    assert has_learning_signal(group([0.0, 0.5, 0.0]))
    assert not has_learning_signal(group([7.0, 0.0, 0.0]))  # only off the mask: nothing trains


def test_has_learning_signal_judges_the_advantages_a_group_already_carries():
    """With distillation the filter runs after the teacher set per-token advantages on a group of equal rewards:
    those are what it judges (signal where a trainable token's is nonzero), not the rewards' zero spread."""
    from training.utils.rl.filters import has_learning_signal
    from training.utils.rl.groups import PromptGroup
    from training.utils.rl.rollout import RolloutSample

    samples = [RolloutSample([1, 2, 3], [0.0, -1.0, -1.0], [0, 1, 1], 0.0) for _ in range(2)]
    pg = PromptGroup(0, {}, 0, samples=samples, completion_index=[0, 1], completion_rewards={0: 0.0, 1: 0.0})
    assert not has_learning_signal(pg)
    pg.compute_advantages()
    assert not has_learning_signal(pg)
    pg.advantages = [[0.0, -0.3, 0.1], [0.0, 0.0, 0.0]]  # the teacher's A_t
    assert has_learning_signal(pg)
    pg.advantages = [[5.0, 0.0, 0.0], [0.0, 0.0, 0.0]]  # nonzero only off the mask
    assert not has_learning_signal(pg)
