"""One training step over prompt groups: old / reference logprobs, then the PPO inner loop.

    l_old  = trainer logprobs under the weights at the start of the step (once, no grad)
    l_ref  = reference model logprobs (only when kl_beta > 0)
    for epoch in ppo_epochs:
        for mini-batch in ppo_mini_batches:     # one optimizer step each
            loss = policy_loss(l, l_old, l_s, l_ref, A, mask), aggregated over the mini-batch
            backward (packed micro-batches accumulate), clip, step

With one epoch and one mini-batch the ratio r = exp(l - l_old) is 1 everywhere, so clipping
is inert: it only matters when ``ppo_epochs * ppo_mini_batches > 1``.
"""

from __future__ import annotations

import random
from typing import Optional

from training.utils.rl.groups import PromptGroup
from training.utils.rl.losses import compute_policy_loss
from training.utils.rl.losses.common import LossInputs
from training.utils.rl.losses.config import LossConfig


def _merge(into: dict[str, float], metrics: dict[str, float], weight: float, weights: dict[str, float]) -> None:
    for k, v in metrics.items():
        if k.endswith("_max"):
            into[k] = max(into.get(k, float("-inf")), v)
        else:
            into[k] = into.get(k, 0.0) + v * weight
            weights[k] = weights.get(k, 0.0) + weight


def train_on_groups(trainer, groups: list[PromptGroup], loss_cfg: LossConfig, *, reference=None,
                    ppo_epochs: int = 1, ppo_mini_batches: int = 1, temperature: float = 1.0,
                    seed: int = 0) -> dict[str, float]:
    """Run the PPO inner loop on ``groups`` (advantages already set); return ``train/*`` metrics."""
    samples = [s for g in groups for s in g.samples]
    advantages = [a for g in groups for a in g.advantages]
    sequences = [s.tokens for s in samples]
    old_logprobs = trainer.logprobs(sequences, temperature=temperature)
    ref_logprobs: Optional[list] = None
    if reference is not None and loss_cfg.kl_beta > 0:
        ref_logprobs = reference.logprobs(sequences, temperature=temperature)

    weighted = any(s.weight != 1.0 for s in samples)
    order = list(range(len(samples)))
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
            mb_samples = [samples[i] for i in idx]
            total_tokens = sum(s.num_trainable_tokens for s in mb_samples)
            # per-sample lists in the order of this mini-batch's sequences (what packed.gather indexes)
            lists = {"old": [old_logprobs[i] for i in idx], "sampler": [s.logprobs for s in mb_samples],
                  "adv": [advantages[i] for i in idx], "mask": [s.loss_mask for s in mb_samples],
                  "ref": None if ref_logprobs is None else [ref_logprobs[i] for i in idx],
                  "weight": [s.weight for s in mb_samples] if weighted else None}

            def loss_fn(packed, logprobs_N, lists=lists, total_tokens=total_tokens, num_sequences=len(idx)):
                inputs = LossInputs(
                    logprobs_N=logprobs_N,
                    old_logprobs_N=packed.gather(lists["old"]),
                    sampler_logprobs_N=packed.gather(lists["sampler"]),
                    advantages_N=packed.gather(lists["adv"]),
                    loss_mask_N=packed.gather(lists["mask"]),
                    sequence_index_N=packed.sequence_index_N,
                    num_sequences=len(packed.sample_indices),
                    ref_logprobs_N=None if lists["ref"] is None else packed.gather(lists["ref"]),
                    sample_weights_N=None if lists["weight"] is None else packed.gather(lists["weight"]),
                )
                return compute_policy_loss(inputs, loss_cfg, total_tokens, num_sequences)

            metrics = trainer.forward_backward([sequences[i] for i in idx], loss_fn, temperature=temperature)
            _merge(sums, metrics, float(total_tokens), weights)
            optim_metrics = trainer.optim_step()
            _merge(sums, {"grad_norm": optim_metrics["grad_norm"], "grad_norm_max": optim_metrics["grad_norm"]},
                   1.0, weights)

    out = {f"train/{k}": (v if k.endswith("_max") else v / max(weights.get(k, 1.0), 1e-12)) for k, v in sums.items()}
    out["train/learning_rate"] = optim_metrics.get("learning_rate", 0.0)
    out["train/optimizer_steps"] = float(ppo_epochs * min(ppo_mini_batches, len(samples)))
    out["train/samples"] = float(len(samples))
    out["train/trainable_tokens"] = float(sum(s.num_trainable_tokens for s in samples))
    out["train/tokens"] = float(sum(len(s.tokens) for s in samples))
    return out
