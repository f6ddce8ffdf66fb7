"""Shared pieces of the policy losses: inputs and outputs, ratios, the TIS weight, k3 KL,
aggregation and metric helpers.

Notation per token t of a packed micro-batch (N tokens, S sequences): l = trainer logprob
(with gradient), l_old = trainer logprob at the start of the step's PPO loop, l_s = the
sampler's logprob, l_ref = reference-model logprob, m = loss mask, A = the token's advantage
A_t (the sample's scalar advantage on every token, or its per-token advantage: ``advantages_N``),
sg = stop-gradient.

- Every log-ratio is clamped to [-20, 20] before ``exp`` (``exp_clamped``).
- Policy ratio: r = exp(clamp(l - l_old)).
- Train/inference correction (TIS): w = min(exp(clamp(l_old - l_s)), cap), no gradient.
  ``tis_level="token"``: per token; ``"sequence"``: one weight per sequence from the
  geometric mean, exp(mean over the sequence's trainable tokens of (l_old - l_s)), capped;
  ``"off"``: w = 1.
- Masked importance sampling (MIS, ``mis_keep``): with rho = exp(l_old - l_s) judged per token, per sequence
  (the product) or by the sequence's geometric mean, a token whose rho lies outside [low, high] is masked out of
  the loss (L_t · 0), where TIS only caps its weight. Off by default.
- KL to the reference (``kl_to_reference``, ``LossConfig.kl_estimator``), d = l - l_ref: k1 d, k2 d^2 / 2,
  k3 exp(-d) + d - 1 (>= 0, the default); differentiable in l.
- Mismatch KL (sampler vs trainer-old, on the sampled tokens): the k3 form with the ratio
  pi_old / pi_s, i.e. mean over trainable tokens of exp(d) - d - 1 with d = l_old - l_s. It is
  a non-negative, unbiased estimate of KL(pi_s || pi_old) because the tokens were drawn from
  pi_s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from training.utils.rl.losses.config import AGGREGATIONS, LossConfig

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to [-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP] before exp."""


@dataclass
class LossInputs:
    """Flat per-token tensors of one packed micro-batch (N tokens, S sequences)."""

    logprobs_N: torch.Tensor
    """Trainer logprobs, WITH gradient."""
    old_logprobs_N: torch.Tensor
    """Trainer logprobs at the start of the step's PPO loop, no grad."""
    sampler_logprobs_N: torch.Tensor
    """The sampler's logprobs from the RolloutSample (0.0 where not generated)."""
    advantages_N: torch.Tensor
    """A_t per token: the sample's scalar advantage copied to each of its tokens, or its per-token advantage
    (``PromptGroup.advantages``: ``RolloutSample.token_advantages``, on-policy distillation) where it has one."""
    loss_mask_N: torch.Tensor
    """Float 0/1: 1 on trainable (generated) tokens."""
    sequence_index_N: torch.Tensor
    """Long, in [0, num_sequences): which sequence each token belongs to."""
    num_sequences: int
    """S: the number of sequences in this micro-batch (each sequence lies wholly inside it)."""
    ref_logprobs_N: Optional[torch.Tensor] = None
    """Reference-model logprobs (None when kl_beta == 0)."""
    sample_weights_N: Optional[torch.Tensor] = None
    """The sample's ``RolloutSample.weight`` copied to each of its tokens; multiplies L_t before aggregation (None = 1)."""


@dataclass
class LossOutput:
    """What a loss function returns: per-token losses and metrics.

    It carries no aggregation: how L_t is reduced is ``compute.loss_aggregation(cfg)`` (the registered loss's own,
    else ``cfg.aggregation``), known before the loss runs, because the PPO step normalises the sample weights
    for that same aggregation before the micro-batches are packed."""

    per_token_loss_N: torch.Tensor
    """L_t for every token (masked tokens may hold anything; aggregation masks them)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Means over the micro-batch's trainable tokens; keys ending in ``_max`` are maxima."""


LossFn = Callable[[LossInputs, LossConfig], LossOutput]


def validate_inputs(inputs: LossInputs) -> None:
    """Raise ``ValueError`` naming the first field of ``inputs`` with a bad shape, dtype or range."""
    n = inputs.logprobs_N.shape
    if inputs.logprobs_N.dim() != 1:
        raise ValueError(f"logprobs_N: expected a 1-D tensor, got shape {tuple(n)}")
    if not inputs.logprobs_N.is_floating_point():
        raise ValueError(f"logprobs_N: expected a floating tensor, got {inputs.logprobs_N.dtype}")
    names = ["old_logprobs_N", "sampler_logprobs_N", "advantages_N", "loss_mask_N", "sequence_index_N"]
    if inputs.ref_logprobs_N is not None:
        names.append("ref_logprobs_N")
    if inputs.sample_weights_N is not None:
        names.append("sample_weights_N")
    for name in names:
        t = getattr(inputs, name)
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if t.shape != n:
            raise ValueError(f"{name}: shape {tuple(t.shape)} != logprobs_N shape {tuple(n)}")
    if inputs.sequence_index_N.dtype != torch.long:
        raise ValueError(f"sequence_index_N: expected dtype torch.long, got {inputs.sequence_index_N.dtype}")
    if not inputs.loss_mask_N.is_floating_point():
        raise ValueError(f"loss_mask_N: expected a float 0/1 tensor, got {inputs.loss_mask_N.dtype}")
    if not isinstance(inputs.num_sequences, int) or inputs.num_sequences < 1:
        raise ValueError(f"num_sequences: must be an int >= 1, got {inputs.num_sequences!r}")
    if n[0] > 0:
        lo, hi = int(inputs.sequence_index_N.min()), int(inputs.sequence_index_N.max())
        if lo < 0 or hi >= inputs.num_sequences:
            raise ValueError(
                f"sequence_index_N: values span [{lo}, {hi}], outside [0, num_sequences={inputs.num_sequences})"
            )


def exp_clamped(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp(clamp(log_ratio, -20, 20)): a ratio that cannot overflow."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def policy_ratio(inputs: LossInputs) -> torch.Tensor:
    """r = exp(clamp(l - l_old, ±20)), differentiable in l."""
    return exp_clamped(inputs.logprobs_N - inputs.old_logprobs_N.detach())


def clip_eps(cfg: LossConfig, default_low: float, default_high: float) -> tuple[float, float]:
    """(eps_low, eps_high): ``cfg.eps_low`` / ``cfg.eps_high`` when set, else the loss's defaults."""
    low = default_low if cfg.eps_low is None else cfg.eps_low
    high = default_high if cfg.eps_high is None else cfg.eps_high
    return low, high


def clipped_surrogate(
    ratio_N: torch.Tensor, advantages_N: torch.Tensor, eps_low: float, eps_high: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate max(-r·A, -clip(r, 1-eps_low, 1+eps_high)·A).

    Returns (loss_N, clipped_N) where ``clipped_N`` (bool) marks tokens on which the clipped
    branch is strictly larger, i.e. tokens that get no gradient.
    """
    unclipped_N = -ratio_N * advantages_N
    clipped_branch_N = -ratio_N.clamp(1.0 - eps_low, 1.0 + eps_high) * advantages_N
    return torch.maximum(unclipped_N, clipped_branch_N), (clipped_branch_N > unclipped_N).detach()


def sequence_sums(values_N: torch.Tensor, sequence_index_N: torch.Tensor, num_sequences: int) -> torch.Tensor:
    """Per-sequence sums of ``values_N`` (differentiable), shape [S]."""
    out_S = torch.zeros(num_sequences, dtype=values_N.dtype, device=values_N.device)
    return out_S.index_add(0, sequence_index_N, values_N)


def masked_sequence_means(
    values_N: torch.Tensor, loss_mask_N: torch.Tensor, sequence_index_N: torch.Tensor, num_sequences: int
) -> torch.Tensor:
    """Per-sequence mean of ``values_N`` over the tokens with mask 1 (0 for a sequence with none), shape [S]."""
    mask_N = loss_mask_N.to(values_N.dtype)
    masked_N = torch.where(mask_N > 0, values_N, torch.zeros_like(values_N))
    sums_S = sequence_sums(masked_N, sequence_index_N, num_sequences)
    counts_S = sequence_sums(mask_N, sequence_index_N, num_sequences)
    return sums_S / counts_S.clamp(min=1.0)


def tis_weight(inputs: LossInputs, cfg: LossConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The train/inference weight w_N = min(exp(l_old - l_s), cfg.tis_cap), no gradient.

    Returns (weight_N, capped_N): ``capped_N`` (bool) marks tokens whose raw weight exceeded the
    cap. ``cfg.tis_level``: ``token`` per token, ``sequence`` one weight per sequence from the
    geometric mean over its trainable tokens, ``off`` all ones.
    """
    with torch.no_grad():
        log_w_N = inputs.old_logprobs_N.detach() - inputs.sampler_logprobs_N.detach()
        if cfg.tis_level == "off":
            ones_N = torch.ones_like(log_w_N)
            return ones_N, torch.zeros_like(log_w_N, dtype=torch.bool)
        if cfg.tis_level == "sequence":
            log_w_S = masked_sequence_means(log_w_N, inputs.loss_mask_N, inputs.sequence_index_N, inputs.num_sequences)
            log_w_N = log_w_S[inputs.sequence_index_N]
        elif cfg.tis_level != "token":
            raise ValueError(f"tis_level: unknown level {cfg.tis_level!r}")
        raw_N = exp_clamped(log_w_N)
        return raw_N.clamp(max=cfg.tis_cap), raw_N > cfg.tis_cap


def k3_kl(logprobs_N: torch.Tensor, ref_logprobs_N: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(pi || pi_ref) per token: exp(l_ref - l) - (l_ref - l) - 1, differentiable in l."""
    d_N = (ref_logprobs_N.detach() - logprobs_N).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return torch.exp(d_N) - d_N - 1.0


def kl_to_reference(logprobs_N: torch.Tensor, ref_logprobs_N: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) on the sampled tokens, differentiable in l, with d = l - l_ref
    (clamped to +-LOG_RATIO_CLAMP): ``k1`` d, ``k2`` d^2 / 2, ``k3`` exp(-d) + d - 1 (``k3_kl``)."""
    if estimator == "k3":
        return k3_kl(logprobs_N, ref_logprobs_N)
    d_N = (logprobs_N - ref_logprobs_N.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        return d_N
    if estimator == "k2":
        return 0.5 * d_N * d_N
    raise ValueError(f"kl_estimator: unknown estimator {estimator!r}")


def mismatch_kl_N(inputs: LossInputs) -> torch.Tensor:
    """Per-token k3 estimate of KL(pi_sampler || pi_old): exp(d) - d - 1 with d = l_old - l_s (no grad)."""
    with torch.no_grad():
        d_N = (inputs.old_logprobs_N - inputs.sampler_logprobs_N).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        return torch.exp(d_N) - d_N - 1.0


def masked_mean(values_N: torch.Tensor, loss_mask_N: torch.Tensor) -> float:
    """Mean of ``values_N`` over tokens with mask 1, as a float (0.0 when there are none)."""
    with torch.no_grad():
        mask_N = loss_mask_N > 0
        count = int(mask_N.sum())
        if count == 0:
            return 0.0
        return float(values_N.detach().to(torch.float64)[mask_N].sum() / count)


def masked_max(values_N: torch.Tensor, loss_mask_N: torch.Tensor) -> float:
    """Max of ``values_N`` over tokens with mask 1, as a float (0.0 when there are none)."""
    with torch.no_grad():
        mask_N = loss_mask_N > 0
        if not bool(mask_N.any()):
            return 0.0
        return float(values_N.detach()[mask_N].max())


def ratio_metrics(ratio_N: torch.Tensor, clipped_N: torch.Tensor, loss_mask_N: torch.Tensor) -> dict[str, float]:
    """``ratio_mean``, ``ratio_max`` and ``clip_fraction`` over the trainable tokens, and the clip fraction per side:
    ``clip_fraction_low`` (clipped with r < 1, the lower bound 1 - eps_low acted) and ``clip_fraction_high`` (clipped
    with r > 1, the upper bound 1 + eps_high acted); the two sum to ``clip_fraction``."""
    with torch.no_grad():
        clipped_N = clipped_N.detach()
        low_N = clipped_N & (ratio_N.detach() < 1.0)
        high_N = clipped_N & (ratio_N.detach() > 1.0)
    return {
        "ratio_mean": masked_mean(ratio_N, loss_mask_N),
        "ratio_max": masked_max(ratio_N, loss_mask_N),
        "clip_fraction": masked_mean(clipped_N.to(ratio_N.dtype), loss_mask_N),
        "clip_fraction_low": masked_mean(low_N.to(ratio_N.dtype), loss_mask_N),
        "clip_fraction_high": masked_mean(high_N.to(ratio_N.dtype), loss_mask_N),
    }


def diagnostic_metrics(inputs: LossInputs, cfg: LossConfig) -> dict[str, float]:
    """Metrics logged for every loss: TIS weight mean and clip fraction (as applied under
    ``cfg.tis_level``), the sampler/trainer-old mismatch KL and ``logprob_diff_mean`` / ``logprob_diff_max`` (|l_old -
    l_sampler| over the trainable tokens: how far the engine's logprobs are from the trainer's), and when reference logprobs are given ``kl_ref`` (the
    estimator of ``cfg.kl_estimator``) and each estimator as ``kl_ref_k1`` / ``kl_ref_k2`` / ``kl_ref_k3``."""
    weight_N, capped_N = tis_weight(inputs, cfg)
    mask_N = inputs.loss_mask_N
    gap_N = (inputs.old_logprobs_N - inputs.sampler_logprobs_N).abs().detach()  # the engine vs the trainer, per token
    metrics = {
        "tis_weight_mean": masked_mean(weight_N, mask_N),
        "tis_weight_max": masked_max(weight_N, mask_N),
        "tis_clip_fraction": masked_mean(capped_N.to(weight_N.dtype), mask_N),
        "mismatch_kl": masked_mean(mismatch_kl_N(inputs), mask_N),
        "logprob_diff_mean": masked_mean(gap_N, mask_N),
        "logprob_diff_max": masked_max(gap_N, mask_N),
    }
    if inputs.ref_logprobs_N is not None:
        with torch.no_grad():
            for estimator in ("k1", "k2", "k3"):
                kl = masked_mean(kl_to_reference(inputs.logprobs_N, inputs.ref_logprobs_N, estimator), mask_N)
                metrics[f"kl_ref_{estimator}"] = kl
            metrics["kl_ref"] = metrics[f"kl_ref_{cfg.kl_estimator}"]
    return metrics


def aggregate(
    per_token_loss_N: torch.Tensor,
    inputs: LossInputs,
    aggregation: str,
    total_tokens: int,
    total_sequences: int,
    constant: Optional[float] = None,
) -> torch.Tensor:
    """Reduce per-token losses of one micro-batch to a scalar with step-wide denominators (T = the step's
    trainable tokens, S = its sequences, |y| = a sequence's trainable tokens, C = ``constant``):

    - ``token_mean``: sum(L·m) / T;
    - ``sequence_mean``: sum over sequences of (sum_t L·m / |y|) / S;
    - ``sequence_mean_token_sum``: sum over sequences of (sum_t L·m) / S;
    - ``constant``: sum(L·m) / (S · C) (Dr. GRPO: C the completion length limit);
    - ``sum``: sum(L·m).

    Summing the results over the micro-batches of a step equals the aggregate over the whole step. Masked positions
    never reach the result (not even NaN). Reduced in at least float32 (bf16 per-token losses are upcast).
    """
    mask_N = inputs.loss_mask_N > 0
    per_token_loss_N = per_token_loss_N.to(torch.promote_types(per_token_loss_N.dtype, torch.float32))
    masked_loss_N = torch.where(mask_N, per_token_loss_N, torch.zeros_like(per_token_loss_N))
    if aggregation == "sum":
        return masked_loss_N.sum()
    if aggregation == "token_mean":
        if total_tokens < 1:
            raise ValueError(f"total_tokens: must be >= 1 for token_mean aggregation, got {total_tokens}")
        return masked_loss_N.sum() / total_tokens
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation: {aggregation!r} is not one of {AGGREGATIONS}")
    if total_sequences < 1:
        raise ValueError(f"total_sequences: must be >= 1 for {aggregation} aggregation, got {total_sequences}")
    if aggregation == "sequence_mean":
        sums_S = sequence_sums(masked_loss_N, inputs.sequence_index_N, inputs.num_sequences)
        counts_S = sequence_sums(mask_N.to(per_token_loss_N.dtype), inputs.sequence_index_N, inputs.num_sequences)
        return (sums_S / counts_S.clamp(min=1.0)).sum() / total_sequences
    if aggregation == "sequence_mean_token_sum":
        return masked_loss_N.sum() / total_sequences
    if constant is None or not constant > 0:
        raise ValueError(f"aggregation_constant: must be > 0 for constant aggregation, got {constant!r}")
    return masked_loss_N.sum() / (total_sequences * constant)


def mis_keep(inputs: LossInputs, cfg: LossConfig) -> Optional[torch.Tensor]:
    """Masked importance sampling: a float 0/1 keep mask ``[N]`` (no gradient), or None when ``cfg.mis_level`` is
    ``off``. With d = l_old - l_s per token and [low, high] = ``cfg.mis_bounds``:

    - ``token``: keep_t = [low <= exp(d_t) <= high];
    - ``sequence``: keep_t = [low <= exp(sum over the sequence's trainable tokens of d) <= high];
    - ``geometric``: keep_t = [low <= exp(mean over the sequence's trainable tokens of d) <= high].

    The log-ratio is compared with log(low), log(high) (no overflow for long sequences). A masked token's loss is
    0; it still counts in the aggregation's denominators (``compute_policy_loss``)."""
    if cfg.mis_level == "off":
        return None
    with torch.no_grad():
        d_N = (inputs.old_logprobs_N.detach() - inputs.sampler_logprobs_N.detach()).to(torch.float64)
        mask_N = inputs.loss_mask_N > 0
        if cfg.mis_level != "token":
            masked_d_N = torch.where(mask_N, d_N, torch.zeros_like(d_N))
            sums_S = sequence_sums(masked_d_N, inputs.sequence_index_N, inputs.num_sequences)
            if cfg.mis_level == "geometric":
                counts_S = sequence_sums(mask_N.to(d_N.dtype), inputs.sequence_index_N, inputs.num_sequences)
                sums_S = sums_S / counts_S.clamp(min=1.0)
            elif cfg.mis_level != "sequence":
                raise ValueError(f"mis_level: unknown level {cfg.mis_level!r}")
            d_N = sums_S[inputs.sequence_index_N]
        low, high = cfg.mis_bounds
        log_low = math.log(low) if low > 0 else -math.inf
        keep_N = (d_N >= log_low) & (d_N <= math.log(high))
        return keep_N.to(inputs.logprobs_N.dtype)


def mis_metrics(keep_N: torch.Tensor, inputs: LossInputs) -> dict[str, float]:
    """``mis_masked_fraction`` (trainable tokens masked) and ``mis_masked_sequence_fraction`` (sequences with a
    trainable token masked) of one micro-batch."""
    with torch.no_grad():
        mask_N = inputs.loss_mask_N > 0
        dropped_N = (keep_N < 0.5) & mask_N
        dropped_S = sequence_sums(dropped_N.to(torch.float64), inputs.sequence_index_N, inputs.num_sequences) > 0
        return {
            "mis_masked_fraction": masked_mean(dropped_N.to(torch.float64), inputs.loss_mask_N),
            "mis_masked_sequence_fraction": float(dropped_S.to(torch.float64).mean()),
        }
