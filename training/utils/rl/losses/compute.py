"""The entry point the trainer calls, and what it asks the registry.

``compute_policy_loss(inputs, cfg, total_tokens, total_sequences)`` runs the loss named by
``cfg.policy_loss`` (or the user's callable) on one packed micro-batch and reduces it with
step-wide denominators, so the sum over a step's micro-batches is the step loss. See
``README.md`` in this folder for the formulas.
"""

from __future__ import annotations

import importlib
from typing import Optional

import torch

from training.utils.rl.losses.common import (
    LossFn,
    LossInputs,
    LossOutput,
    aggregate,
    diagnostic_metrics,
    mis_keep,
    mis_metrics,
    validate_inputs,
)
from training.utils.rl.losses.config import LossConfig
from training.utils.rl.losses.registry import LOSSES, RegisteredLoss, loss_names

for _name in loss_names():  # every loss module, imported so that its @register_loss fills LOSSES
    importlib.import_module(f"training.utils.rl.losses.{_name}")
if sorted(LOSSES) != list(loss_names()):
    raise ImportError(f"loss modules that do not register themselves: {sorted(set(loss_names()) - set(LOSSES))}")

LOSSES_USING_REFERENCE = frozenset(name for name, loss in LOSSES.items() if loss.uses_reference)
"""Built-in losses that add the k3 KL penalty (and so need reference logprobs when kl_beta > 0): ``uses_reference``
in the registry."""


def registered_loss(cfg: LossConfig) -> Optional[RegisteredLoss]:
    """The registry's entry for ``cfg.policy_loss``; None for a callable. An unknown name (``cfg`` mutated
    after validation) raises a ``ValueError`` naming the field."""
    if callable(cfg.policy_loss):
        return None
    try:
        return LOSSES[cfg.policy_loss]
    except KeyError:
        raise ValueError(
            f"policy_loss: unknown loss {cfg.policy_loss!r}; choose one of {sorted(LOSSES)} or pass a callable"
        ) from None


def resolve_loss(cfg: LossConfig) -> LossFn:
    """The loss function for ``cfg.policy_loss``: a callable is returned as is (the user escape
    hatch), a name is looked up in ``LOSSES``."""
    loss = registered_loss(cfg)
    return cfg.policy_loss if loss is None else loss.fn


def needs_reference_logprobs(cfg: LossConfig) -> bool:
    """Whether the trainer must compute reference logprobs: kl_beta > 0 and the loss uses them
    (a registered loss with ``uses_reference``, i.e. grpo, or any user callable, which may), or the penalty goes in
    the advantages (``kl_in_reward``)."""
    if cfg.kl_beta <= 0:
        return False
    if cfg.kl_in_reward:
        return True
    loss = registered_loss(cfg)
    return loss is None or loss.uses_reference


def loss_aggregation(cfg: LossConfig) -> str:
    """The aggregation of the configured loss: ``cfg.aggregation`` when given (for every loss), else the registered
    loss's own (gspo: ``sequence_mean``), else the default ``token_mean`` (a user callable's is ``cfg.aggregation``).

    The one place it is decided: the PPO step normalises sample weights for it (``ppo.normalised_weights``) and
    ``compute_policy_loss`` reduces with it, so a sample is weighted and reduced the same way."""
    loss = registered_loss(cfg)
    if not cfg.aggregation_given and loss is not None and loss.aggregation is not None:
        return loss.aggregation
    return str(cfg.aggregation)


def compute_policy_loss(
    inputs: LossInputs, cfg: LossConfig, total_tokens: int, total_sequences: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """Run the configured loss on one micro-batch and aggregate it.

    ``total_tokens`` / ``total_sequences`` are the trainable tokens / sequences of the whole
    optimizer step (all micro-batches), so summing the returned losses over the step's
    micro-batches equals the aggregate over the step:
    ``token_mean`` → sum(L·m) / total_tokens; ``sequence_mean`` → sum over sequences of
    (sum_t L·m / |y_seq|) / total_sequences; ``sequence_mean_token_sum`` → sum(L·m) / total_sequences;
    ``constant`` → sum(L·m) / (total_sequences · cfg.aggregation_constant); ``sum`` → sum(L·m), with the aggregation
    ``loss_aggregation(cfg)`` decides (``cfg.aggregation`` when given, else the loss's own, e.g. gspo's
    ``sequence_mean``). ``inputs.sample_weights_N``, when given, multiplies L_t first (a sample of weight w counts
    w times); with ``cfg.mis_level`` on, the masked-IS keep mask multiplies it too (``common.mis_keep``).

    Metrics (unprefixed floats over this micro-batch's trainable tokens; ``*_max`` are maxima):
    the loss's own (e.g. ``clip_fraction``, ``ratio_mean``, ``ratio_max``), plus always
    ``tis_weight_mean``, ``tis_weight_max``, ``tis_clip_fraction``, ``mismatch_kl`` (k3 estimate of
    KL(sampler || trainer-old)), ``kl_ref`` when reference logprobs are given, ``mis_masked_fraction`` and
    ``mis_masked_sequence_fraction`` when ``cfg.mis_level`` is on, and ``loss`` (this micro-batch's contribution to
    the step loss).
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
    keep_N = mis_keep(inputs, cfg)
    if keep_N is not None:  # masked, not multiplied: a NaN or inf loss on a masked token must not reach the sum
        per_token_loss_N = torch.where(keep_N > 0, per_token_loss_N, torch.zeros_like(per_token_loss_N))
    loss = aggregate(
        per_token_loss_N, inputs, loss_aggregation(cfg), total_tokens, total_sequences, cfg.aggregation_constant
    )
    metrics = diagnostic_metrics(inputs, cfg)
    metrics.update(output.metrics)
    if keep_N is not None:
        metrics.update(mis_metrics(keep_N, inputs))
    metrics["loss"] = float(loss.detach())
    return loss, metrics
