"""The KL penalty in the advantages (``LossConfig.kl_in_reward``, training/utils/rl/kl_reward.py): the formula against
a hand computation, and a PPO step with it equal to a step without any KL whose advantages were moved by hand."""

import dataclasses
import math

import pytest
import torch

from training.trainer import PolicyTrainer, ReferenceModel
from training.utils.config import TrainerConfig
from training.utils.rl.kl_reward import kl_reward_advantages
from training.utils.rl.losses.compute import needs_reference_logprobs
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.ppo import StepBatch, train_on_batch


def test_each_trained_token_loses_beta_times_the_penalty_still_to_come():
    old = [[0.0, -1.0, -2.0, -0.5, -3.0]]
    ref = [[0.0, -1.5, -1.0, -0.5, -9.0]]
    mask = [[0, 1, 1, 1, 0]]
    d = [0.5, -1.0, 0.0]  # l_old - l_ref on the trained tokens
    k3 = [math.exp(-x) + x - 1 for x in d]
    for a, base in ((0.7, [0.7] * 5), ([0.1, 0.2, 0.3, 0.4, 0.5], [0.1, 0.2, 0.3, 0.4, 0.5])):
        [got], [penalty] = kl_reward_advantages([a], old, ref, mask, 0.2, "k3")
        want = [base[0], base[1] - 0.2 * sum(k3), base[2] - 0.2 * (k3[1] + k3[2]), base[3] - 0.2 * k3[2], base[4]]
        assert got == pytest.approx(want, abs=1e-12) and penalty == pytest.approx(0.2 * sum(k3), abs=1e-12)
    [k1], _ = kl_reward_advantages([0.0], old, ref, mask, 1.0, "k1")
    assert k1 == pytest.approx([0.0, -(0.5 - 1.0 + 0.0), -(-1.0 + 0.0), -0.0, 0.0], abs=1e-12)


def test_kl_in_reward_loads_a_reference_for_any_loss_and_needs_a_coefficient():
    assert needs_reference_logprobs(LossConfig(policy_loss="cispo", kl_beta=0.1, kl_in_reward=True))
    assert not needs_reference_logprobs(LossConfig(policy_loss="cispo", kl_beta=0.1))
    with pytest.raises(ValueError, match="^kl_in_reward: needs kl_beta > 0"):
        LossConfig(kl_beta=0.0, kl_in_reward=True)


def test_a_step_with_the_kl_in_the_reward_is_a_step_on_the_moved_advantages_without_kl(tiny_model_path):
    prompt = [5, 17, 42, 99, 7]
    completions = [[11, 23, 5, 8], [40, 2, 9, 31, 77, 6], [3, 3, 19]]
    batch = StepBatch(
        tokens=[prompt + c for c in completions],
        sampler_logprobs=[[0.0] * (len(prompt) + len(c)) for c in completions],
        loss_masks=[[0] * len(prompt) + [1] * len(c) for c in completions],
        advantages=[1.0, -0.5, 0.25],
        weights=[1.0] * 3,
    )
    reference = ReferenceModel(tiny_model_path, TrainerConfig(device="cpu"))

    def moved_trainer():  # one plain step first, so the policy is away from the reference
        trainer = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=5e-2))
        train_on_batch(trainer, batch, LossConfig(kl_beta=0.0))
        return trainer

    in_reward, by_hand = moved_trainer(), moved_trainer()
    cfg = LossConfig(kl_beta=0.5, kl_in_reward=True, kl_estimator="k3")
    metrics = train_on_batch(in_reward, batch, cfg, reference=reference)
    moved, penalties = kl_reward_advantages(
        batch.advantages,
        by_hand.logprobs(batch.tokens),
        reference.logprobs(batch.tokens),
        batch.loss_masks,
        0.5,
        "k3",
    )
    assert min(penalties) > 1e-4, "the reference differs from the policy: the check can fail"
    assert metrics["train/kl_reward_penalty_mean"] == pytest.approx(sum(penalties) / 3, rel=1e-6)
    assert metrics["train/kl_ref_k3"] > 0  # still logged, not charged in the loss
    train_on_batch(by_hand, dataclasses.replace(batch, advantages=moved), LossConfig(kl_beta=0.0))
    for (name, a), (_, b) in zip(in_reward.model.named_parameters(), by_hand.model.named_parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5, msg=name)
    charged = PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=5e-2))
    train_on_batch(charged, batch, LossConfig(kl_beta=0.0))
    train_on_batch(charged, batch, LossConfig(kl_beta=0.5), reference=reference)  # the KL in the loss instead
    assert any(
        not torch.allclose(a, b, atol=1e-6) for a, b in zip(charged.model.parameters(), in_reward.model.parameters())
    )


def test_kl_in_reward_with_gae_is_refused_naming_the_setting():
    from training.recipes.config import Config
    from training.utils.config import ConfigError

    with pytest.raises(ConfigError, match="^loss.kl_in_reward: not built with advantage='gae'"):
        Config(base_model="m", advantage="gae", loss=LossConfig(kl_beta=0.1, kl_in_reward=True))
    assert "kl_in_reward" not in Config(base_model="m").to_dict()["loss"]  # recorded runs resume unchanged
    assert Config(base_model="m", loss=LossConfig(kl_beta=0.1, kl_in_reward=True)).to_dict()["loss"]["kl_in_reward"]
