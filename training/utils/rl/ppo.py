"""One training step over prompt groups: old / reference logprobs, then the PPO inner loop.

    l_old  = trainer logprobs under the weights at the start of the step (once, no grad)
    l_ref  = reference model logprobs (only when kl_beta > 0)
    for epoch in ppo_epochs:
        for mini-batch in ppo_mini_batches:     # one optimizer step each
            loss = policy_loss(l, l_old, l_s, l_ref, A, mask), aggregated over the mini-batch
            backward (packed micro-batches accumulate), clip, step

With one epoch and one mini-batch the ratio r = exp(l - l_old) is 1 everywhere, so clipping
is inert: it only matters when ``ppo_epochs * ppo_mini_batches > 1``. In that case the weights at
the start of the step are the ones the single backward pass runs under, so ``l_old`` is taken as
``l.detach()`` from that pass instead of from a separate no-grad forward (a forward saved per step,
and r is exactly 1 rather than 1 up to the rounding of two packings).

Under ``torchrun`` rank 0 calls ``train_on_groups``: it announces a TRAIN command, sends the
step's ``StepBatch`` to the other ranks as tensors (``StepBatch.broadcast``) and the PPO
settings with it; every rank then runs ``train_on_batch`` on the whole batch, and the
trainer splits each call's sequences over the ranks (see ``training/trainer/distributed.py``).
The loss of every micro-batch is divided by the mini-batch's global trainable-token (or
sequence) count, so the gradients summed over micro-batches and ranks equal the one-process
gradient.

With a critic (``advantage="gae"``: ``trainer.critic``, ``training/utils/rl/gae.py``) the step starts with one
no-grad forward that gives l_old and V_old together (``trainer.logprobs_and_values``); each sample's scalar advantage
is then its return R, and GAE over its trainable tokens replaces it with per-token advantages (whitened over the step
when ``critic.whiten``) and value targets G. Every mini-batch's forward computes V beside l on the same packed batch
and adds ``value_loss_coef`` · the clipped value loss to the policy loss; the head steps with the policy
(``train/value_*`` metrics, ``train/value_explained_variance`` of V_old against G).

Sample weights (``RolloutSample.weight``, e.g. 1/n for the n transitions of one episode) make
the loss a weighted mean, normalised by the weighted count for the loss's aggregation
(``loss_aggregation(cfg)``, the one ``compute_policy_loss`` reduces with): per mini-batch each weight is
rescaled, w'_i = w_i · sum_j T_j / sum_j w_j·T_j (``token_mean``, ``constant`` and ``sum``; T = trainable
tokens) or w'_i = w_i · S / sum_j w_j (``sequence_mean``, gspo, and ``sequence_mean_token_sum``), so that
``token_mean`` = sum_i w_i·sum_t L / sum_i w_i·T_i and ``sequence_mean`` = sum_i w_i·mean_t L / sum_i w_i.
An episode split into n transitions of weight 1/n then trains as hard as its one stitched
sample (the same loss when episodes have equal n), and with ``sequence_mean`` every episode
counts once in either mode.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional, Union

import torch

from training.utils import dist as dist_utils
from training.utils.dist import Command, broadcast_tensor, lead
from training.utils.rl.gae import explained_variance, step_gae, value_loss
from training.utils.rl.groups import PromptGroup
from training.utils.rl.kl_reward import kl_reward_advantages
from training.utils.rl.losses import compute_policy_loss, loss_aggregation
from training.utils.rl.losses.common import LossInputs
from training.utils.rl.losses.config import SEQUENCE_AGGREGATIONS, LossConfig


def normalised_weights(weights: list[float], trainable_tokens: list[int], aggregation: str) -> list[float]:
    """Sample weights rescaled so the aggregate is a weighted mean (module docstring); unchanged if all are 0."""
    if aggregation in SEQUENCE_AGGREGATIONS:
        total, weighted = float(len(weights)), sum(weights)
    else:
        total, weighted = float(sum(trainable_tokens)), sum(w * t for w, t in zip(weights, trainable_tokens))
    if weighted <= 0:
        return list(weights)
    return [w * total / weighted for w in weights]


def _merge(into: dict[str, float], metrics: dict[str, float], weight: float, weights: dict[str, float]) -> None:
    for k, v in metrics.items():
        if k.endswith("_max"):
            into[k] = max(into.get(k, float("-inf")), v)
        else:
            into[k] = into.get(k, 0.0) + v * weight
            weights[k] = weights.get(k, 0.0) + weight


@dataclass
class StepBatch:
    """One step's training data, sample by sample (what rank 0 sends to the other ranks).

    ``tokens[i]``, ``sampler_logprobs[i]`` and ``loss_masks[i]`` are parallel per-token lists
    (as in ``RolloutSample``); ``weights[i]`` is per sample; ``advantages[i]`` is the sample's scalar
    advantage or a per-token list parallel to ``tokens[i]`` (``PromptGroup.advantages``).
    """

    tokens: list[list[int]]
    sampler_logprobs: list[list[float]]
    loss_masks: list[list[int]]
    advantages: list[Union[float, list[float]]]
    weights: list[float]

    @classmethod
    def from_groups(cls, groups: list[PromptGroup]) -> "StepBatch":
        samples = [s for g in groups for s in g.samples]
        return cls(
            tokens=[s.tokens for s in samples],
            sampler_logprobs=[s.logprobs for s in samples],
            loss_masks=[s.loss_mask for s in samples],
            advantages=[a for g in groups for a in g.advantages],
            weights=[s.weight for s in samples],
        )

    def __len__(self) -> int:
        return len(self.tokens)

    def num_trainable_tokens(self, i: int) -> int:
        return sum(self.loss_masks[i])

    @staticmethod
    def broadcast(batch: Optional["StepBatch"]) -> "StepBatch":
        """Rank 0's batch on every rank (others pass None), as flat tensors: lengths ``[S]``, then
        tokens / sampler logprobs / masks / advantages ``[sum of lengths]`` (a scalar advantage repeated over its
        sequence), then per sample whether its advantage is per token and its weight ``[S]``.
        Float values travel as float64, so every rank sees exactly rank 0's numbers."""
        main = dist_utils.is_main_rank()
        if main:
            lengths_S = torch.tensor([len(t) for t in batch.tokens], dtype=torch.int64)
            per_token_advantages = [
                a if isinstance(a, list) else [float(a)] * len(t) for a, t in zip(batch.advantages, batch.tokens)
            ]
            flat = [
                torch.tensor([x for seq in lists for x in seq], dtype=dtype)
                for lists, dtype in (
                    (batch.tokens, torch.int64),
                    (batch.sampler_logprobs, torch.float64),
                    (batch.loss_masks, torch.int64),
                    (per_token_advantages, torch.float64),
                )
            ]
            per_token_S = torch.tensor([isinstance(a, list) for a in batch.advantages], dtype=torch.int64)
            weights = torch.tensor(batch.weights, dtype=torch.float64)
        lengths = broadcast_tensor(lengths_S if main else None, torch.int64).tolist()
        tokens_N, logprobs_N, masks_N, advantages_N = (
            broadcast_tensor(flat[k] if main else None, dtype)
            for k, dtype in enumerate((torch.int64, torch.float64, torch.int64, torch.float64))
        )
        per_token = broadcast_tensor(per_token_S if main else None, torch.int64).tolist()
        weights_S = broadcast_tensor(weights if main else None, torch.float64)
        if main:
            return batch

        def split(values_N: torch.Tensor) -> list[list]:
            return [piece.tolist() for piece in torch.split(values_N, lengths)]

        return StepBatch(
            tokens=split(tokens_N),
            sampler_logprobs=split(logprobs_N),
            loss_masks=split(masks_N),
            advantages=[a if listed else a[0] for a, listed in zip(split(advantages_N), per_token)],
            weights=weights_S.tolist(),
        )


def refreshes_reference(loss_cfg: LossConfig, steps_done: int) -> bool:
    """Whether the step that brings the run to ``steps_done`` ends with a reference refresh (every
    ``loss_cfg.reference_refresh_interval`` steps; never at 0)."""
    interval = loss_cfg.reference_refresh_interval
    return bool(interval) and steps_done % interval == 0


def train_on_groups(
    trainer,
    groups: list[PromptGroup],
    loss_cfg: LossConfig,
    *,
    reference=None,
    ppo_epochs: int = 1,
    ppo_mini_batches: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    refresh_reference: bool = False,
) -> dict[str, float]:
    """Run the PPO inner loop on ``groups`` (advantages already set); return ``train/*`` metrics. ``refresh_reference``:
    after the update the reference becomes a copy of the policy (``LossConfig.reference_refresh_interval``).

    Under torchrun (rank 0 only) it first hands the batch and the PPO settings to the other
    ranks, which run ``receive_and_train`` at the same time.
    """
    batch = StepBatch.from_groups(groups)
    with lead(Command.TRAIN):
        if dist_utils.is_distributed():
            StepBatch.broadcast(batch)
            broadcast_tensor(
                torch.tensor(
                    [ppo_epochs, ppo_mini_batches, seed, temperature, float(refresh_reference)], dtype=torch.float64
                ),
                torch.float64,
            )
        return train_on_batch(
            trainer,
            batch,
            loss_cfg,
            reference=reference,
            ppo_epochs=ppo_epochs,
            ppo_mini_batches=ppo_mini_batches,
            temperature=temperature,
            seed=seed,
            refresh_reference=refresh_reference,
        )


def receive_and_train(trainer, loss_cfg: LossConfig, *, reference=None) -> dict[str, float]:
    """A non-zero rank's side of ``train_on_groups``: receive the batch and settings, train on it."""
    batch = StepBatch.broadcast(None)
    epochs, mini_batches, seed, temperature, refresh = broadcast_tensor(None, torch.float64).tolist()
    return train_on_batch(
        trainer,
        batch,
        loss_cfg,
        reference=reference,
        ppo_epochs=int(epochs),
        ppo_mini_batches=int(mini_batches),
        temperature=temperature,
        seed=int(seed),
        refresh_reference=bool(refresh),
    )


def train_on_batch(
    trainer,
    batch: StepBatch,
    loss_cfg: LossConfig,
    *,
    reference=None,
    ppo_epochs: int = 1,
    ppo_mini_batches: int = 1,
    temperature: float = 1.0,
    seed: int = 0,
    refresh_reference: bool = False,
) -> dict[str, float]:
    """The PPO inner loop on one ``StepBatch`` (see the module docstring); ``train/*`` metrics. ``refresh_reference``:
    the reference copies the updated policy at the end (``ReferenceModel.refresh_from``)."""
    n = len(batch)
    sequences = batch.tokens
    # one optimizer step over the whole batch: l_old is the pass's own logprobs, detached (module docstring)
    single_update = ppo_epochs * min(ppo_mini_batches, n) == 1
    critic = getattr(trainer, "critic", None)
    old_values = targets = None
    if critic is not None:  # l_old and V_old from one pre-update forward; GAE replaces the returns (docstring)
        logprobs_before, old_values = trainer.logprobs_and_values(sequences, temperature=temperature)
        old_logprobs = None if single_update else logprobs_before
        advantages, targets = step_gae(batch.advantages, old_values, batch.loss_masks, critic.cfg)
        batch = dataclasses.replace(batch, advantages=advantages)
    else:
        old_logprobs = None if single_update else trainer.logprobs(sequences, temperature=temperature)
    ref_logprobs: Optional[list] = None
    if reference is not None and loss_cfg.kl_beta > 0:
        ref_logprobs = reference.logprobs(sequences, temperature=temperature)
    kl_penalties = None
    if ref_logprobs is not None and loss_cfg.kl_in_reward:  # the penalty moves into the advantages (kl_reward.py)
        before = old_logprobs if old_logprobs is not None else trainer.logprobs(sequences, temperature=temperature)
        advantages, kl_penalties = kl_reward_advantages(
            batch.advantages, before, ref_logprobs, batch.loss_masks, loss_cfg.kl_beta, loss_cfg.kl_estimator
        )
        batch = dataclasses.replace(batch, advantages=advantages)
        loss_cfg = dataclasses.replace(loss_cfg, kl_beta=0.0, kl_in_reward=False)  # no second charge in the loss

    weighted = any(w != 1.0 for w in batch.weights)
    order = list(range(n))
    rng = random.Random(seed)
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    optim_metrics: dict[str, float] = {}
    for epoch in range(ppo_epochs):
        if epoch > 0:
            rng.shuffle(order)
        for k in range(ppo_mini_batches):
            idx = order[k::ppo_mini_batches]
            if not idx:
                continue
            total_tokens = sum(batch.num_trainable_tokens(i) for i in idx)
            # per-sample lists in the order of this mini-batch's sequences (what packed.gather indexes)
            lists = {
                "old": None if old_logprobs is None else [old_logprobs[i] for i in idx],
                "sampler": [batch.sampler_logprobs[i] for i in idx],
                "adv": [batch.advantages[i] for i in idx],
                "mask": [batch.loss_masks[i] for i in idx],
                "ref": None if ref_logprobs is None else [ref_logprobs[i] for i in idx],
                "weight": normalised_weights(
                    [batch.weights[i] for i in idx],
                    [batch.num_trainable_tokens(i) for i in idx],
                    loss_aggregation(loss_cfg),
                )
                if weighted
                else None,
                "old_values": None if old_values is None else [old_values[i] for i in idx],
                "targets": None if targets is None else [targets[i] for i in idx],
            }

            num_sequences = len(idx)

            def loss_fn(
                packed, logprobs_N, values_N=None, lists=lists, total_tokens=total_tokens, num_sequences=num_sequences
            ):
                inputs = LossInputs(
                    logprobs_N=logprobs_N,
                    old_logprobs_N=logprobs_N.detach() if lists["old"] is None else packed.gather(lists["old"]),
                    sampler_logprobs_N=packed.gather(lists["sampler"]),
                    advantages_N=packed.gather(lists["adv"]),
                    loss_mask_N=packed.gather(lists["mask"]),
                    sequence_index_N=packed.sequence_index_N,
                    num_sequences=len(packed.sample_indices),
                    ref_logprobs_N=None if lists["ref"] is None else packed.gather(lists["ref"]),
                    sample_weights_N=None if lists["weight"] is None else packed.gather(lists["weight"]),
                )
                loss, metrics = compute_policy_loss(inputs, loss_cfg, total_tokens, num_sequences)
                if values_N is None:
                    return loss, metrics
                critic_loss, critic_metrics = value_loss(
                    values_N,
                    packed.gather(lists["old_values"]),
                    packed.gather(lists["targets"]),
                    inputs,
                    loss_cfg,
                    critic.cfg,
                    total_tokens,
                    num_sequences,
                )
                return loss + critic_loss, {**metrics, **critic_metrics}

            mini_batch = [sequences[i] for i in idx]
            if critic is None:
                metrics = trainer.forward_backward(mini_batch, loss_fn, temperature=temperature)
            else:
                metrics = trainer.forward_backward(mini_batch, loss_fn, temperature=temperature, with_values=True)
            _merge(sums, metrics, float(total_tokens), weights)
            optim_metrics = trainer.optim_step()
            norms = {"grad_norm": optim_metrics["grad_norm"], "grad_norm_max": optim_metrics["grad_norm"]}
            if "value_grad_norm" in optim_metrics:
                norms["value_grad_norm"] = optim_metrics["value_grad_norm"]
            _merge(sums, norms, 1.0, weights)

    out = {f"train/{k}": (v if k.endswith("_max") else v / max(weights.get(k, 1.0), 1e-12)) for k, v in sums.items()}
    out["train/learning_rate"] = optim_metrics.get("learning_rate", 0.0)
    if "gpu_memory_peak_gb" in optim_metrics:  # the trainer on CUDA
        out["perf/gpu_memory_peak_gb"] = optim_metrics["gpu_memory_peak_gb"]
    out["train/optimizer_steps"] = float(ppo_epochs * min(ppo_mini_batches, n))
    out["train/samples"] = float(n)
    out["train/trainable_tokens"] = float(sum(batch.num_trainable_tokens(i) for i in range(n)))
    out["train/tokens"] = float(sum(len(t) for t in sequences))
    out.update(batch_distribution_metrics(batch))
    if kl_penalties is not None:
        out["train/kl_reward_penalty_mean"] = sum(kl_penalties) / len(kl_penalties)
    if refresh_reference and reference is not None:
        reference.refresh_from(trainer)
        out["train/reference_refreshed"] = 1.0
    if targets is not None:
        out["train/value_explained_variance"] = explained_variance(old_values, targets, batch.loss_masks)
    return out


def batch_distribution_metrics(batch: StepBatch) -> dict[str, float]:
    """What a step trained on, over its trainable tokens (``loss_mask`` 1): ``train/advantage_mean`` / ``_std`` /
    ``_min`` / ``_max`` (a scalar advantage counts once per trainable token of its sample),
    ``train/advantage_zero_fraction`` (the share of samples whose every trainable token has advantage 0: no learning
    signal), and ``train/sampled_entropy``, the mean of -log p_sampler over the sampled tokens (the Monte-Carlo
    estimate of the sampling distribution's per-token entropy; falling fast is entropy collapse)."""
    values: list[float] = []
    nll: list[float] = []
    zero = 0
    for adv, mask, logprobs in zip(batch.advantages, batch.loss_masks, batch.sampler_logprobs):
        own = [a for a, m in zip(adv, mask) if m] if isinstance(adv, list) else [float(adv)] * sum(mask)
        values.extend(own)
        nll.extend(-lp for lp, m in zip(logprobs, mask) if m)
        zero += all(a == 0.0 for a in own)
    if not values:
        return {}
    mean = sum(values) / len(values)
    return {
        "train/advantage_mean": mean,
        "train/advantage_std": (sum((v - mean) ** 2 for v in values) / len(values)) ** 0.5,
        "train/advantage_min": min(values),
        "train/advantage_max": max(values),
        "train/advantage_zero_fraction": zero / max(len(batch), 1),
        "train/sampled_entropy": sum(nll) / len(nll),
    }
