"""The loss registry and the entry point the trainer calls (re-exported by the package ``__init__``).

``compute_policy_loss(inputs, cfg, total_tokens, total_sequences)`` runs the loss named by
``cfg.policy_loss`` (or the user's callable) on one packed micro-batch and reduces it with
step-wide denominators, so the sum over a step's micro-batches is the step loss. See
``README.md`` in this folder for the formulas.
"""

from __future__ import annotations

import torch

from training.utils.rl.losses.cispo import cispo_loss
from training.utils.rl.losses.common import (
    LossFn,
    LossInputs,
    LossOutput,
    aggregate,
    diagnostic_metrics,
    validate_inputs,
)
from training.utils.rl.losses.config import LOSS_NAMES, LossConfig
from training.utils.rl.losses.dapo import dapo_loss
from training.utils.rl.losses.dro import dro_loss
from training.utils.rl.losses.grpo import grpo_loss
from training.utils.rl.losses.gspo import gspo_loss
from training.utils.rl.losses.importance_sampling import importance_sampling_loss
from training.utils.rl.losses.reinforce import reinforce_loss

LOSSES: dict[str, LossFn] = {
    "grpo": grpo_loss,
    "importance_sampling": importance_sampling_loss,
    "reinforce": reinforce_loss,
    "dapo": dapo_loss,
    "dro": dro_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""Registered loss names → loss functions ``(LossInputs, LossConfig) -> LossOutput``."""
assert tuple(LOSSES) == LOSS_NAMES, "LOSS_NAMES (config.py) and LOSSES must list the same losses"

LOSSES_USING_REFERENCE = frozenset({"grpo"})
"""Built-in losses that add the k3 KL penalty (and so need reference logprobs when kl_beta > 0)."""


def resolve_loss(cfg: LossConfig) -> LossFn:
    """The loss function for ``cfg.policy_loss``: a callable is returned as is (the user escape
    hatch), a name is looked up in ``LOSSES``."""
    if callable(cfg.policy_loss):
        return cfg.policy_loss
    try:
        return LOSSES[cfg.policy_loss]
    except KeyError:
        raise ValueError(
            f"policy_loss: unknown loss {cfg.policy_loss!r}; choose one of {sorted(LOSSES)} or pass a callable"
        ) from None


def needs_reference_logprobs(cfg: LossConfig) -> bool:
    """Whether the trainer must compute reference logprobs: kl_beta > 0 and the loss uses them
    (grpo, or any user callable, which may)."""
    if cfg.kl_beta <= 0:
        return False
    return callable(cfg.policy_loss) or cfg.policy_loss in LOSSES_USING_REFERENCE


def compute_policy_loss(
    inputs: LossInputs, cfg: LossConfig, total_tokens: int, total_sequences: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the configured loss on one micro-batch and aggregate it.

    ``total_tokens`` / ``total_sequences`` are the trainable tokens / sequences of the whole
    optimizer step (all micro-batches), so summing the returned losses over the step's
    micro-batches equals the aggregate over the step:
    ``token_mean`` → sum(L·m) / total_tokens; ``sequence_mean`` → sum over sequences of
    (sum_t L·m / |y_seq|) / total_sequences; ``sum`` → sum(L·m). The loss's own aggregation
    (gspo: ``sequence_mean``) overrides ``cfg.aggregation``. ``inputs.sample_weights_N``, when
    given, multiplies L_t first (a sample of weight w counts w times).

    Metrics (unprefixed floats over this micro-batch's trainable tokens; ``*_max`` are maxima):
    the loss's own (e.g. ``clip_fraction``, ``ratio_mean``, ``ratio_max``), plus always
    ``tis_weight_mean``, ``tis_weight_max``, ``tis_clip_fraction``, ``mismatch_kl`` (k3 estimate of
    KL(sampler || trainer-old)), ``kl_ref`` when reference logprobs are given, and ``loss`` (this
    micro-batch's contribution to the step loss).
    """
    validate_inputs(inputs)
    num_trainable = int((inputs.loss_mask_N > 0).sum())
    if num_trainable > total_tokens:
        raise ValueError(
            f"total_tokens: {total_tokens} is fewer than this micro-batch's {num_trainable} trainable tokens; "
            "pass the step-wide count"
        )
    if inputs.num_sequences > total_sequences:
        raise ValueError(
            f"total_sequences: {total_sequences} is fewer than this micro-batch's {inputs.num_sequences} sequences; "
            "pass the step-wide count"
        )
    output = resolve_loss(cfg)(inputs, cfg)
    if not isinstance(output, LossOutput):
        raise TypeError(f"policy_loss: the loss function must return a LossOutput, got {type(output).__name__}")
    if output.per_token_loss_N.shape != inputs.logprobs_N.shape:
        raise ValueError(
            f"per_token_loss_N: shape {tuple(output.per_token_loss_N.shape)} != logprobs_N shape "
            f"{tuple(inputs.logprobs_N.shape)}"
        )
    per_token_loss_N = output.per_token_loss_N
    if inputs.sample_weights_N is not None:
        per_token_loss_N = per_token_loss_N * inputs.sample_weights_N
    loss = aggregate(per_token_loss_N, inputs, output.aggregation or cfg.aggregation, total_tokens, total_sequences)
    metrics = diagnostic_metrics(inputs, cfg)
    metrics.update(output.metrics)
    metrics["loss"] = float(loss.detach())
    return loss, metrics


__all__ = [
    "LOSSES",
    "LOSSES_USING_REFERENCE",
    "LossConfig",
    "LossFn",
    "LossInputs",
    "LossOutput",
    "compute_policy_loss",
    "needs_reference_logprobs",
    "resolve_loss",
]
