"""PPO with a critic: generalised advantage estimation (GAE) over a sample's completion tokens and the clipped value
loss (``Config.advantage="gae"``, settings in ``Config.critic``: ``CriticConfig``).

The critic is a value head on the policy's final hidden states (``training/trainer/value_head.py``); V_t is its
estimate of the return from the state just before completion token t (read from the hidden state that predicts
token t). A sample's steps are its trainable tokens (``loss_mask`` 1), in order, p_1 < ... < p_K: tokens the
environment wrote (tool output, a user turn) are not steps, so the recursion runs from one generated token to the
next generated one. The sample's return R (its reward, per-call credit included: ``r_s``) is the reward of its last
step, every other step's reward is 0, and V_{K+1} = 0 (the episode ends)::

    delta_k = r_k + gamma * V_{k+1} - V_k
    A_k     = delta_k + gamma * lam * A_{k+1}          (A_{K+1} = 0)
    G_k     = A_k + V_k                                 (the value target, the lambda-return)

With gamma = lam = 1 (the defaults) A_k = R - V_k, the Monte-Carlo return minus the value. With ``whiten`` the
step's advantages are then shifted and scaled to mean 0 and std 1 over all its trainable tokens (the targets G are
not). The value loss per trainable token, with V_old the head's value before this step's first update::

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L^V_t  = 0.5 * max((V - G)^2, (V_clip - G)^2)

aggregated over the mini-batch exactly like the policy loss (``losses.common.aggregate``, the same sample weights)
and added to it times ``value_loss_coef``. The head reads the hidden states detached, so the value loss trains the
head alone and the policy's gradient is that of the policy loss.
"""

from __future__ import annotations

import math
from typing import Union

import torch

from training.utils.rl.losses.common import LossInputs, aggregate, masked_mean
from training.utils.rl.losses.compute import loss_aggregation
from training.utils.rl.critic_config import CriticConfig
from training.utils.rl.losses.config import LossConfig


def gae_advantages(
    reward: float, values_T: list[float], loss_mask_T: list[int], gamma: float, lam: float
) -> tuple[list[float], list[float]]:
    """GAE of one sample (module docstring): ``(advantages_T, returns_T)``, parallel to ``values_T`` and 0.0 where
    ``loss_mask_T`` is 0. ``reward`` is the sample's return R, earned at its last trainable token."""
    if len(values_T) != len(loss_mask_T):
        raise ValueError(f"values_T, loss_mask_T: lengths {len(values_T)} and {len(loss_mask_T)} differ")
    if not math.isfinite(reward):
        raise ValueError(f"reward: {reward!r} is not a finite number")
    steps = [t for t, m in enumerate(loss_mask_T) if m]
    advantages_T = [0.0] * len(values_T)
    returns_T = [0.0] * len(values_T)
    next_value, next_advantage = 0.0, 0.0
    for k in range(len(steps) - 1, -1, -1):
        t = steps[k]
        r = float(reward) if k == len(steps) - 1 else 0.0
        delta = r + gamma * next_value - values_T[t]
        next_advantage = delta + gamma * lam * next_advantage
        next_value = values_T[t]
        advantages_T[t] = next_advantage
        returns_T[t] = next_advantage + values_T[t]
    return advantages_T, returns_T


def whiten(advantages_S: list[list[float]], loss_masks_S: list[list[int]]) -> list[list[float]]:
    """Advantages shifted and scaled to mean 0, std 1 (population std, + 1e-8) over every trainable token of the
    step; masked tokens stay 0.0. A step with fewer than two trainable tokens is returned unchanged."""
    values = [a for adv, mask in zip(advantages_S, loss_masks_S) for a, m in zip(adv, mask) if m]
    if len(values) < 2:
        return [list(a) for a in advantages_S]
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    scale = 1.0 / (std + 1e-8)
    return [
        [(a - mean) * scale if m else 0.0 for a, m in zip(adv, mask)] for adv, mask in zip(advantages_S, loss_masks_S)
    ]


def clipped_value_loss_N(
    values_N: torch.Tensor, old_values_N: torch.Tensor, returns_N: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token L^V = 0.5 * max((V - G)^2, (V_old + clip(V - V_old, -eps, eps) - G)^2) (module docstring), and a
    0/1 tensor of where the clipped term is the larger (it holds V's gradient at 0 there). ``clip`` 0 = unclipped."""
    if clip <= 0:
        return 0.5 * (values_N - returns_N) ** 2, torch.zeros_like(values_N)
    clipped_N = old_values_N + (values_N - old_values_N).clamp(-clip, clip)
    plain_N = (values_N - returns_N) ** 2
    clipped_sq_N = (clipped_N - returns_N) ** 2
    return 0.5 * torch.maximum(plain_N, clipped_sq_N), (clipped_sq_N > plain_N).to(values_N.dtype)


def step_gae(
    returns_S: list[Union[float, list[float]]],
    values_S: list[list[float]],
    loss_masks_S: list[list[int]],
    cfg: CriticConfig,
) -> tuple[list[list[float]], list[list[float]]]:
    """GAE of a step's samples: ``(advantages_S, targets_S)``, per-token lists (whitened when ``cfg.whiten``).

    ``returns_S[i]``: sample i's return R (what the ``gae`` estimator set as its scalar advantage);
    ``values_S[i]``: V per token before the step's first update. A per-token list in ``returns_S`` (a rollout's
    ``token_advantages``) is refused: GAE computes each token's advantage itself."""
    advantages_S, targets_S = [], []
    for i, (reward, values_T, mask_T) in enumerate(zip(returns_S, values_S, loss_masks_S)):
        if isinstance(reward, list):
            raise ValueError(
                f"advantage='gae': sample {i} carries per-token advantages (RolloutSample.token_advantages); "
                "GAE computes them from the critic, so drop token_advantages or choose another estimator"
            )
        advantages_T, targets_T = gae_advantages(float(reward), values_T, mask_T, cfg.gamma, cfg.lam)
        advantages_S.append(advantages_T)
        targets_S.append(targets_T)
    if cfg.whiten:
        advantages_S = whiten(advantages_S, loss_masks_S)
    return advantages_S, targets_S


def explained_variance(
    values_S: list[list[float]], targets_S: list[list[float]], loss_masks_S: list[list[int]]
) -> float:
    """1 - Var(G - V) / Var(G) over the step's trainable tokens (1 = V predicts the targets, <= 0 = no better than
    their mean); 0.0 when the targets do not vary."""
    pairs = [(v, g) for vs, gs, ms in zip(values_S, targets_S, loss_masks_S) for v, g, m in zip(vs, gs, ms) if m]
    if len(pairs) < 2:
        return 0.0

    def variance(xs: list[float]) -> float:
        mean = math.fsum(xs) / len(xs)
        return math.fsum((x - mean) ** 2 for x in xs) / len(xs)

    spread = variance([g for _, g in pairs])
    return 0.0 if spread == 0 else 1.0 - variance([g - v for v, g in pairs]) / spread


def value_loss(
    values_N: torch.Tensor,
    old_values_N: torch.Tensor,
    targets_N: torch.Tensor,
    inputs: LossInputs,
    loss_cfg: LossConfig,
    cfg: CriticConfig,
    total_tokens: int,
    total_sequences: int,
) -> tuple[torch.Tensor, dict[str, float]]:
    """``value_loss_coef`` · the clipped value loss of one micro-batch, aggregated like the policy loss (the same
    aggregation, step-wide denominators and ``inputs.sample_weights_N``), and its metrics over the micro-batch's
    trainable tokens: ``value_loss`` (mean L^V), ``value_clip_fraction``, ``value_mean``, ``value_target_mean``."""
    per_token_N, clipped_N = clipped_value_loss_N(values_N, old_values_N, targets_N, cfg.value_clip)
    weighted_N = per_token_N if inputs.sample_weights_N is None else per_token_N * inputs.sample_weights_N
    loss = aggregate(
        weighted_N, inputs, loss_aggregation(loss_cfg), total_tokens, total_sequences, loss_cfg.aggregation_constant
    )
    metrics = {
        "value_loss": masked_mean(per_token_N, inputs.loss_mask_N),
        "value_clip_fraction": masked_mean(clipped_N, inputs.loss_mask_N),
        "value_mean": masked_mean(values_N, inputs.loss_mask_N),
        "value_target_mean": masked_mean(targets_N, inputs.loss_mask_N),
    }
    return cfg.value_loss_coef * loss, metrics
