"""PPO with a critic (``training/utils/rl/gae.py``) against hand computations in float64: the GAE recursion over a
sample's trainable tokens, whitening, the clipped value loss's value and gradient, explained variance, the ``gae``
estimator's returns and ``Config.critic``'s checks."""

from __future__ import annotations

import pytest
import torch

from training.recipes.config import Config
from training.utils.cli import apply_overrides
from training.utils.config import ConfigError
from training.utils.rl.advantages import ADVANTAGE_ESTIMATORS, credited_advantages, group_advantages
from training.utils.rl.distillation import DistillationConfig
from training.utils.rl.gae import (
    CriticConfig,
    clipped_value_loss_N,
    explained_variance,
    gae_advantages,
    step_gae,
    value_loss,
    whiten,
)
from training.utils.rl.losses.common import LossInputs
from training.utils.rl.losses.config import LossConfig


def test_gae_follows_the_recursion_over_the_trainable_tokens():
    """Steps at t = 2, 3, 4 with V = 0.5, 0.2, 0.9, R = 1, gamma 0.9, lam 0.8:
    delta_3 = 1 - 0.9 = 0.1; delta_2 = 0.9·0.9 - 0.2 = 0.61; delta_1 = 0.9·0.2 - 0.5 = -0.32;
    A_3 = 0.1, A_2 = 0.61 + 0.72·0.1 = 0.682, A_1 = -0.32 + 0.72·0.682 = 0.17104; G = A + V."""
    values = [0.0, 0.3, 0.5, 0.2, 0.9]
    advantages, returns = gae_advantages(1.0, values, [0, 0, 1, 1, 1], gamma=0.9, lam=0.8)
    assert advantages == pytest.approx([0.0, 0.0, 0.17104, 0.682, 0.1], rel=1e-13, abs=1e-15)
    assert returns == pytest.approx([0.0, 0.0, 0.67104, 0.882, 1.0], rel=1e-13, abs=1e-15)


def test_gae_at_gamma_and_lambda_one_is_the_return_minus_the_value():
    values = [0.0, 0.25, -0.5, 0.75]
    advantages, returns = gae_advantages(2.0, values, [0, 1, 1, 1], gamma=1.0, lam=1.0)
    assert advantages == pytest.approx([0.0, 1.75, 2.5, 1.25], rel=1e-15)
    assert returns == pytest.approx([0.0, 2.0, 2.0, 2.0], rel=1e-15)


def test_gae_skips_the_tokens_the_environment_wrote():
    """A tool-output token between two generated ones is no step: its value (99) never enters the recursion.
    gamma 0.5, lam 1, R = 1: A_2 = 1 - 0.3 = 0.7; A_0 = 0.5·0.3 - 0.1 + 0.5·0.7 = 0.4."""
    advantages, _ = gae_advantages(1.0, [0.1, 99.0, 0.3], [1, 0, 1], gamma=0.5, lam=1.0)
    assert advantages == pytest.approx([0.4, 0.0, 0.7], rel=1e-14)


def test_whitening_gives_mean_zero_std_one_over_trainable_tokens():
    advantages = [[0.0, 1.0, 3.0], [0.0, 5.0, 0.0]]
    masks = [[0, 1, 1], [1, 1, 0]]
    out = whiten(advantages, masks)
    values = [a for adv, m in zip(out, masks) for a, k in zip(adv, m) if k]
    mean = sum(values) / 4
    assert mean == pytest.approx(0.0, abs=1e-15)
    assert (sum(v * v for v in values) / 4) ** 0.5 == pytest.approx(1.0, rel=1e-7)
    assert out[0][0] == 0.0 and out[1][2] == 0.0  # masked tokens stay 0
    # hand: values 1, 3, 0, 5: mean 2.25, population std sqrt(3.6875)
    assert out[0][1] == pytest.approx((1 - 2.25) / 3.6875**0.5, rel=1e-7)


def _inputs(mask, weights=None) -> LossInputs:
    n = len(mask)
    zeros = torch.zeros(n, dtype=torch.float64)
    return LossInputs(
        logprobs_N=zeros,
        old_logprobs_N=zeros,
        sampler_logprobs_N=zeros,
        advantages_N=zeros,
        loss_mask_N=torch.tensor(mask, dtype=torch.float64),
        sequence_index_N=torch.zeros(n, dtype=torch.long),
        num_sequences=1,
        sample_weights_N=None if weights is None else torch.tensor(weights, dtype=torch.float64),
    )


def test_clipped_value_loss_value_and_gradient_match_the_hand_formula():
    """eps 0.2. t0: V - V_old = 0.5 clips to 0.2 (V_clip 0.7): plain (1)^2 = 1 > 0.49, L = 0.5, dL/dV = V - G = 1.
    t1: V = V_old: both 0.25, L = 0.125, dL/dV = -0.5. t2: V - V_old = -0.3 clips to -0.2 (V_clip 0.1): clipped
    0.01 > plain 0, L = 0.005, dL/dV = 0 (the clipped term is flat in V). t3 is masked out."""
    values = torch.tensor([1.0, 0.5, 0.0, 7.0], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.3, 0.0], dtype=torch.float64)
    targets = torch.tensor([0.0, 1.0, 0.0, 0.0], dtype=torch.float64)
    per_token, clipped = clipped_value_loss_N(values, old, targets, 0.2)
    assert per_token[:3].tolist() == pytest.approx([0.5, 0.125, 0.005], rel=1e-14)
    assert clipped[:3].tolist() == [0.0, 0.0, 1.0]
    cfg = CriticConfig(value_loss_coef=0.5, value_clip=0.2)
    loss, metrics = value_loss(values, old, targets, _inputs([1, 1, 1, 0]), LossConfig(), cfg, 3, 1)
    assert float(loss.detach()) == pytest.approx(0.5 * (0.5 + 0.125 + 0.005) / 3, rel=1e-14)  # token_mean over T = 3
    loss.backward()
    assert values.grad.tolist() == pytest.approx([0.5 * 1.0 / 3, 0.5 * -0.5 / 3, 0.0, 0.0], rel=1e-14, abs=1e-16)
    assert metrics["value_clip_fraction"] == pytest.approx(1 / 3)
    assert metrics["value_loss"] == pytest.approx((0.5 + 0.125 + 0.005) / 3)


def test_value_loss_uses_the_policy_losss_aggregation_and_sample_weights():
    """sequence_mean over one sequence of three tokens equals token_mean over T = 3; a weight of 2 doubles it."""
    values = torch.tensor([1.0, 0.0, 0.5], dtype=torch.float64)
    targets = torch.zeros(3, dtype=torch.float64)
    cfg = CriticConfig(value_loss_coef=1.0, value_clip=0.0)  # 0 = unclipped
    plain = 0.5 * (1.0 + 0.0 + 0.25) / 3
    seq, _ = value_loss(values, values, targets, _inputs([1, 1, 1]), LossConfig(aggregation="sequence_mean"), cfg, 3, 1)
    assert float(seq) == pytest.approx(plain, rel=1e-14)
    heavy, _ = value_loss(values, values, targets, _inputs([1, 1, 1], [2.0] * 3), LossConfig(), cfg, 3, 1)
    assert float(heavy) == pytest.approx(2 * plain, rel=1e-14)


def test_step_gae_refuses_token_advantages_and_whitens_over_the_step():
    masks = [[0, 1, 1], [0, 1, 1]]
    values = [[0.0, 0.5, 0.5], [0.0, 0.0, 0.0]]
    advantages, targets = step_gae([1.0, 0.0], values, masks, CriticConfig())
    assert targets == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]  # gamma = lam = 1: G = R on every step
    raw = [0.5, 0.5, 0.0, 0.0]  # R - V; whitened: mean 0.25, std 0.25
    assert [a for adv in advantages for a in adv[1:]] == pytest.approx([(r - 0.25) / 0.25 for r in raw], rel=1e-7)
    with pytest.raises(ValueError, match="sample 1 carries per-token advantages"):
        step_gae([1.0, [0.0, 1.0, 1.0]], values, masks, CriticConfig())


def test_explained_variance_matches_its_formula():
    values, targets, masks = [[0.0, 1.0, 2.0]], [[0.0, 1.0, 3.0]], [[0, 1, 1]]
    # trainable pairs (1, 1), (2, 3): Var(G) = 1, Var(G - V) = Var([0, 1]) = 0.25
    assert explained_variance(values, targets, masks) == pytest.approx(0.75)
    assert explained_variance(values, [[0.0, 1.0, 1.0]], masks) == 0.0


def test_the_gae_estimator_gives_each_sample_its_return_even_in_a_zero_variance_group():
    assert ADVANTAGE_ESTIMATORS["gae"].critic
    assert [n for n, e in ADVANTAGE_ESTIMATORS.items() if e.critic] == ["gae"]
    assert group_advantages([1.0, 0.0, 0.5], "gae") == [1.0, 0.0, 0.5]
    assert group_advantages([0.3, 0.3], "gae") == [0.3, 0.3]  # the critic still learns V = 0.3 from it
    # per-call credit: the value target is the sample's own reward r_s = g_s·R_c + i_s
    assert credited_advantages([1.0, 0.0], [0, 0, 1], [1.1, 0.5, -0.2], [1.0, 0.5, 1.0], "gae") == [1.1, 0.5, -0.2]


def test_config_critic_needs_gae_and_stays_out_of_the_record_at_its_defaults():
    assert "critic" not in Config(base_model="m").to_dict()
    cfg = apply_overrides(Config(base_model="m"), ["advantage=gae", "critic.lam=0.95"])
    assert cfg.advantage_estimator == "gae" and cfg.critic.lam == 0.95
    assert cfg.to_dict()["critic"]["lam"] == 0.95
    with pytest.raises(ConfigError, match="critic.*advantage='gae'"):
        Config(base_model="m", critic=CriticConfig(gamma=0.9))
    with pytest.raises(ConfigError, match="critic.gamma"):
        CriticConfig(gamma=1.5)
    with pytest.raises(ConfigError, match="critic.learning_rate"):
        CriticConfig(learning_rate=0.0)
    with pytest.raises(ConfigError, match="distillation"):
        Config(base_model="m", advantage="gae", distillation=DistillationConfig(teacher_model="t"))
