"""Every registered policy loss against values worked out by hand (plain Python floats), plus the
registry, aggregation, the micro-batch accumulation identity and a tiny optimisation per loss."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from training.utils.rl.losses import (
    LOSSES,
    LossConfig,
    LossInputs,
    LossOutput,
    compute_policy_loss,
    loss_aggregation,
    needs_reference_logprobs,
    resolve_loss,
)
from training.utils.rl.losses.config import AGGREGATIONS
from training.utils.rl.losses.registry import NOT_LOSSES


ALL_LOSSES = sorted(LOSSES)
"""Every test over all losses reads the registry: a new loss is tested without editing a list here."""
LOSSES_DIR = Path(__file__).resolve().parents[3] / "training" / "utils" / "rl" / "losses"
NOT_A_LOSS = NOT_LOSSES  # the modules of the folder that are not losses (registry.py says which)
LN = math.log
E = math.exp


def make_inputs(
    logprobs: list[float],
    advantages: list[float],
    old: list[float] | None = None,
    sampler: list[float] | None = None,
    mask: list[float] | None = None,
    seq: list[int] | None = None,
    ref: list[float] | None = None,
) -> LossInputs:
    """Per-token lists → float64 LossInputs; ``logprobs_N`` is a leaf with grad. Defaults: old =
    logprobs, sampler = old, mask all 1, each token its own sequence."""
    n = len(logprobs)
    old = list(logprobs) if old is None else old
    sampler = list(old) if sampler is None else sampler
    mask = [1.0] * n if mask is None else mask
    seq = list(range(n)) if seq is None else seq

    def f64(values):
        return torch.tensor(values, dtype=torch.float64)

    return LossInputs(
        logprobs_N=f64(logprobs).requires_grad_(True),
        old_logprobs_N=f64(old),
        sampler_logprobs_N=f64(sampler),
        advantages_N=f64(advantages),
        loss_mask_N=f64(mask),
        sequence_index_N=torch.tensor(seq, dtype=torch.long),
        num_sequences=max(seq) + 1,
        ref_logprobs_N=None if ref is None else f64(ref),
    )


def per_token(name: str, inputs: LossInputs, **cfg_kwargs) -> list[float]:
    return LOSSES[name].fn(inputs, LossConfig(policy_loss=name, **cfg_kwargs)).per_token_loss_N.tolist()


def summed_grad(name: str, inputs: LossInputs, **cfg_kwargs) -> tuple[float, list[float], dict]:
    """Loss with ``sum`` aggregation (gspo, left unset, keeps its sequence_mean), its gradient w.r.t. logprobs_N,
    metrics."""
    own = {} if LOSSES[name].aggregation else {"aggregation": "sum"}
    cfg = LossConfig(policy_loss=name, **own, **cfg_kwargs)
    n_tok = int(inputs.loss_mask_N.sum())
    loss, metrics = compute_policy_loss(inputs, cfg, total_tokens=n_tok, total_sequences=inputs.num_sequences)
    loss.backward()
    return loss.item(), inputs.logprobs_N.grad.tolist(), metrics


def ratio_inputs(ratios: list[float], advantages: list[float], **kwargs) -> LossInputs:
    """Single-token sequences with l_old = -1 and l = -1 + log r."""
    return make_inputs([-1.0 + LN(r) for r in ratios], advantages, old=[-1.0] * len(ratios), **kwargs)


# ---------------------------------------------------------------- registry and config


def test_registry_holds_exactly_the_loss_modules_of_the_folder():
    modules = sorted(p.stem for p in LOSSES_DIR.glob("*.py") if p.stem not in NOT_A_LOSS)
    assert len(modules) >= 7
    assert sorted(LOSSES) == modules  # a loss file that does not register itself, or a stray entry, fails here
    for name, loss in LOSSES.items():
        assert loss.name == name
        assert loss.fn.__name__ == f"{name}_loss" and loss.fn.__module__ == f"training.utils.rl.losses.{name}"
        assert resolve_loss(LossConfig(policy_loss=name)) is loss.fn
        assert loss.aggregation in (None, *AGGREGATIONS)


def test_the_registry_carries_each_loss_aggregation_and_a_given_one_applies_to_every_loss():
    assert LOSSES["gspo"].aggregation == "sequence_mean"  # its definition: every sequence counts once
    for name in ALL_LOSSES:
        assert loss_aggregation(LossConfig(policy_loss=name)) == (LOSSES[name].aggregation or "token_mean"), name
        for configured in AGGREGATIONS:
            cfg = LossConfig(policy_loss=name, aggregation=configured, aggregation_constant=4.0)
            assert loss_aggregation(cfg) == configured, name
    assert loss_aggregation(LossConfig(policy_loss=lambda i, c: None, aggregation="sum")) == "sum"


def test_unknown_loss_name_rejected_by_config():
    with pytest.raises(ValueError, match="policy_loss: unknown loss 'ppo'"):
        LossConfig(policy_loss="ppo")
    with pytest.raises(ValueError, match="policy_loss"):
        LossConfig(policy_loss=3)
    cfg = LossConfig()
    cfg.policy_loss = "nope"  # mutated after validation: resolve_loss still names the field
    with pytest.raises(ValueError, match="policy_loss: unknown loss 'nope'"):
        resolve_loss(cfg)


def test_user_callable_is_the_escape_hatch():
    def my_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
        return LossOutput(-inputs.logprobs_N * inputs.advantages_N, {"custom_metric": 7.0})

    cfg = LossConfig(policy_loss=my_loss, aggregation="sum")
    assert resolve_loss(cfg) is my_loss
    inputs = make_inputs([-0.5, -2.0], [1.0, -1.0])
    loss, metrics = compute_policy_loss(inputs, cfg, total_tokens=2, total_sequences=2)
    assert loss.item() == pytest.approx(0.5 - 2.0)
    assert metrics["custom_metric"] == 7.0
    assert {"tis_weight_mean", "tis_clip_fraction", "mismatch_kl", "loss"} <= set(metrics)
    assert needs_reference_logprobs(cfg)

    bad_cfg = LossConfig(policy_loss=lambda inputs, cfg: inputs.logprobs_N)
    with pytest.raises(TypeError, match="LossOutput"):
        compute_policy_loss(make_inputs([-1.0], [1.0]), bad_cfg, 1, 1)


def test_only_grpo_and_callables_need_reference_logprobs():
    assert needs_reference_logprobs(LossConfig(policy_loss="grpo", kl_beta=0.01))
    assert not needs_reference_logprobs(LossConfig(policy_loss="grpo", kl_beta=0.0))
    for name in set(ALL_LOSSES) - {"grpo"}:
        assert not needs_reference_logprobs(LossConfig(policy_loss=name, kl_beta=0.01))


# ---------------------------------------------------------------- grpo / dapo clipping


def test_grpo_clip_boundaries_both_sides_and_signs():
    ratios = [1.5, 0.5, 1.5, 0.5, 1.1, 0.9]
    advs = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0]
    # max(-r A, -clip(r, 0.8, 1.2) A)
    expected = [-1.2, -0.5, 1.5, 0.8, -1.1, 0.9]
    # gradient of -r A w.r.t. l is -r A on the unclipped branch, 0 on the clipped one
    expected_grad = [0.0, -0.5, 1.5, 0.0, -1.1, 0.9]
    assert per_token("grpo", ratio_inputs(ratios, advs)) == pytest.approx(expected)
    loss, grad, metrics = summed_grad("grpo", ratio_inputs(ratios, advs))
    assert loss == pytest.approx(sum(expected))
    assert grad == pytest.approx(expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(2 / 6)
    assert metrics["ratio_max"] == pytest.approx(1.5)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 6)


def test_grpo_uses_cfg_eps_when_set():
    inputs = ratio_inputs([1.5, 0.5], [1.0, -1.0])
    # eps_high 0.6 -> upper bound 1.6 (1.5 unclipped); eps_low 0.1 -> lower bound 0.9
    assert per_token("grpo", inputs, eps_low=0.1, eps_high=0.6) == pytest.approx([-1.5, 0.9])


def test_dapo_asymmetric_clip():
    ratios = [1.25, 1.3, 0.75, 0.85]
    advs = [1.0, 1.0, -1.0, -1.0]
    # bounds [0.8, 1.28]; grpo's 1.2 would have clipped 1.25
    expected = [-1.25, -1.28, 0.8, 0.85]
    expected_grad = [-1.25, 0.0, 0.0, 0.85]
    assert per_token("dapo", ratio_inputs(ratios, advs)) == pytest.approx(expected)
    assert per_token("grpo", ratio_inputs(ratios, advs))[0] == pytest.approx(-1.2)
    _, grad, metrics = summed_grad("dapo", ratio_inputs(ratios, advs))
    assert grad == pytest.approx(expected_grad)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def test_dapo_dual_clip_bounds_negative_advantage_loss():
    ratios = [4.0, 2.0, 4.0]
    advs = [-1.0, -1.0, 1.0]
    # A<0: min(-c A, max(-r A, -clip(r) A)) with c = 3; A>0 unaffected by the dual clip
    expected = [3.0, 2.0, -1.28]
    expected_grad = [0.0, 2.0, 0.0]
    assert per_token("dapo", ratio_inputs(ratios, advs), dual_clip=3.0) == pytest.approx(expected)
    _, grad, metrics = summed_grad("dapo", ratio_inputs(ratios, advs), dual_clip=3.0)
    assert grad == pytest.approx(expected_grad)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)
    # without the dual clip the first token's loss is the unbounded 4.0
    assert per_token("dapo", ratio_inputs(ratios, advs))[0] == pytest.approx(4.0)


# ---------------------------------------------------------------- TIS weight and KL


def test_tis_weight_per_token_with_cap():
    # r = 1, A = 1: grpo loss = -w; w = min(exp(l_old - l_s), 5)
    inputs = make_inputs([-1.0, -1.0], [1.0, 1.0], sampler=[-1.0 - LN(10.0), -1.0 - LN(2.0)])
    assert per_token("grpo", inputs) == pytest.approx([-5.0, -2.0])
    _, _, metrics = summed_grad("grpo", inputs)
    assert metrics["tis_weight_mean"] == pytest.approx(3.5)
    assert metrics["tis_weight_max"] == pytest.approx(5.0)
    assert metrics["tis_clip_fraction"] == pytest.approx(0.5)
    # mismatch_kl: mean of exp(d) - d - 1 with d = l_old - l_s
    expected_kl = ((10 - LN(10) - 1) + (2 - LN(2) - 1)) / 2
    assert metrics["mismatch_kl"] == pytest.approx(expected_kl)
    assert metrics["logprob_diff_mean"] == pytest.approx((LN(10) + LN(2)) / 2)  # |l_old - l_s| per token
    assert metrics["logprob_diff_max"] == pytest.approx(LN(10))


def test_tis_weight_per_sequence_is_capped_geometric_mean_over_trainable_tokens():
    # one sequence: prompt token (mask 0, its huge diff must be ignored), then d = log 2, log 8
    old = [-1.0, -1.0, -1.0]
    sampler = [-1.0 - 5.0, -1.0 - LN(2.0), -1.0 - LN(8.0)]

    def inputs() -> LossInputs:
        return make_inputs(old, [1.0] * 3, sampler=sampler, mask=[0.0, 1.0, 1.0], seq=[0, 0, 0])

    # geometric mean of 2 and 8 = 4
    assert per_token("grpo", inputs(), tis_level="sequence")[1:] == pytest.approx([-4.0, -4.0])
    assert per_token("grpo", inputs(), tis_level="sequence", tis_cap=3.0)[1:] == pytest.approx([-3.0, -3.0])
    _, _, metrics = summed_grad("grpo", inputs(), tis_level="sequence", tis_cap=3.0)
    assert metrics["tis_clip_fraction"] == pytest.approx(1.0)
    assert metrics["tis_weight_mean"] == pytest.approx(3.0)
    # off: w = 1
    assert per_token("grpo", inputs(), tis_level="off")[1:] == pytest.approx([-1.0, -1.0])


def test_tis_weight_carries_no_gradient():
    inputs = make_inputs([-1.0], [1.0], sampler=[-1.0 - LN(2.0)])
    _, grad, _ = summed_grad("grpo", inputs)
    assert grad == pytest.approx([-2.0])  # -r A w with r = 1, w = 2: w is a constant


def test_grpo_adds_k3_kl_not_tis_weighted_and_other_losses_do_not():
    # r = 1, w = 2, A = 1; l_ref - l = -0.5
    kwargs = dict(sampler=[-1.0 - LN(2.0)], ref=[-1.5])
    k3 = E(-0.5) + 0.5 - 1.0
    loss, grad, metrics = summed_grad("grpo", make_inputs([-1.0], [1.0], **kwargs), kl_beta=0.1)
    assert loss == pytest.approx(-2.0 + 0.1 * k3)
    # d k3 / d l = 1 - exp(l_ref - l)
    assert grad == pytest.approx([-2.0 + 0.1 * (1.0 - E(-0.5))])
    assert metrics["kl_ref"] == pytest.approx(k3)
    assert per_token("grpo", make_inputs([-1.0], [1.0], **kwargs), kl_beta=0.0) == pytest.approx([-2.0])
    assert per_token("grpo", make_inputs([-1.0], [1.0], sampler=[-1.0 - LN(2.0)]), kl_beta=0.1) == pytest.approx([-2.0])
    assert per_token("dapo", make_inputs([-1.0], [1.0], **kwargs), kl_beta=0.1) == pytest.approx([-2.0])


# ---------------------------------------------------------------- the unclipped losses


def test_importance_sampling_is_unclipped_and_tis_weighted():
    # r = 1.5 and 3.0, w = 2
    inputs = ratio_inputs([1.5, 3.0], [1.0, -1.0], sampler=[-1.0 - LN(2.0)] * 2)
    assert per_token("importance_sampling", inputs) == pytest.approx([-3.0, 6.0])
    _, grad, metrics = summed_grad(
        "importance_sampling", ratio_inputs([1.5, 3.0], [1.0, -1.0], sampler=[-1.0 - LN(2.0)] * 2)
    )
    assert grad == pytest.approx([-3.0, 6.0])
    assert metrics["clip_fraction"] == 0.0


def test_reinforce_uses_ratio_to_sampler_and_no_tis_weight():
    # l - l_s = log 1.5; l_old is far away (would give a capped TIS weight of 5) and must not matter
    inputs = make_inputs([-1.0], [2.0], old=[-5.0], sampler=[-1.0 - LN(1.5)])
    assert per_token("reinforce", inputs) == pytest.approx([-3.0])
    _, grad, metrics = summed_grad("reinforce", make_inputs([-1.0], [2.0], old=[-5.0], sampler=[-1.0 - LN(1.5)]))
    assert grad == pytest.approx([-3.0])
    assert metrics["ratio_mean"] == pytest.approx(1.5)
    assert metrics["tis_weight_mean"] == pytest.approx(E(-5.0 + 1.0 + LN(1.5)))  # reported, not applied


def test_dro_policy_term_and_quadratic_penalty():
    # l = -0.5, l_old = -0.7, A = 1, w = 2, beta = 0.05: -(l A w - 0.5 beta (l - l_old)^2)
    inputs = make_inputs([-0.5], [1.0], old=[-0.7], sampler=[-0.7 - LN(2.0)])
    expected = -(-0.5 * 1.0 * 2.0 - 0.5 * 0.05 * 0.2**2)
    assert per_token("dro", inputs) == pytest.approx([expected])
    _, grad, metrics = summed_grad("dro", make_inputs([-0.5], [1.0], old=[-0.7], sampler=[-0.7 - LN(2.0)]))
    assert grad == pytest.approx([-(1.0 * 2.0 - 0.05 * 0.2)])
    assert metrics["dro_penalty"] == pytest.approx(0.5 * 0.05 * 0.04)


def test_dro_quadratic_term_applies_where_advantage_is_zero():
    # documented choice: the penalty is on for A = 0 and pulls l back toward l_old
    inputs = make_inputs([-0.5], [0.0], old=[-0.7])
    assert per_token("dro", inputs) == pytest.approx([0.5 * 0.05 * 0.04])
    _, grad, _ = summed_grad("dro", make_inputs([-0.5], [0.0], old=[-0.7]))
    assert grad == pytest.approx([0.05 * 0.2])
    assert per_token("dro", make_inputs([-0.5], [0.0], old=[-0.7]), dro_beta=0.0) == pytest.approx([0.0])


def test_cispo_clipped_weight_is_detached_and_gradient_flows_through_logprob():
    ratios, advs = [1.5, 0.5, 1.1], [1.0, -1.0, 1.0]
    lps = [-1.0 + LN(r) for r in ratios]
    weights = [1.28, 0.8, 1.1]  # clip(r, 0.8, 1.28)
    expected = [-w * lp * a for w, lp, a in zip(weights, lps, advs)]
    assert per_token("cispo", ratio_inputs(ratios, advs)) == pytest.approx(expected)
    _, grad, metrics = summed_grad("cispo", ratio_inputs(ratios, advs))
    # clipped tokens still get a gradient: -clip(r) A
    assert grad == pytest.approx([-1.28, 0.8, -1.1])
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------- gspo


def test_gspo_sequence_ratio_over_trainable_tokens_only():
    old = [-1.0] * 4
    mask = [0.0, 1.0, 1.0, 1.0]
    diffs = [3.0, 0.1, 0.2, 0.3]  # s = mean(0.1, 0.2, 0.3) = 0.2; the masked 3.0 is excluded
    lps = [o + d for o, d in zip(old, diffs)]
    rho = E(0.2)  # 1.2214 > 1.2

    # A = +1: clipped at 1.2 on every token, no gradient
    pos = make_inputs(lps, [1.0] * 4, old=old, mask=mask, seq=[0] * 4)
    assert per_token("gspo", pos)[1:] == pytest.approx([-1.2] * 3)
    loss, grad, metrics = summed_grad("gspo", make_inputs(lps, [1.0] * 4, old=old, mask=mask, seq=[0] * 4))
    assert loss == pytest.approx(-1.2)
    assert grad == pytest.approx([0.0] * 4)
    assert metrics["clip_fraction"] == pytest.approx(1.0)

    # A = -1: unclipped, L_t = rho; sequence mean over 3 tokens, d rho_t / d l_t = rho
    loss, grad, _ = summed_grad("gspo", make_inputs(lps, [-1.0] * 4, old=old, mask=mask, seq=[0] * 4))
    assert loss == pytest.approx(rho)  # aggregation left unset: gspo's own sequence mean
    assert grad == pytest.approx([0.0, rho / 3, rho / 3, rho / 3])

    # changing the masked position's logprob does not change s
    lps_changed = [-8.0] + lps[1:]
    loss_changed, _, _ = summed_grad("gspo", make_inputs(lps_changed, [-1.0] * 4, old=old, mask=mask, seq=[0] * 4))
    assert loss_changed == pytest.approx(rho)


def test_gspo_ratio_is_per_sequence_and_capped_above():
    # two sequences: s0 = mean(0.1, -0.1) = 0, s1 = 0.05
    old = [-1.0, -1.0, -1.0]
    inputs = make_inputs([-0.9, -1.1, -0.95], [-1.0] * 3, old=old, seq=[0, 0, 1])
    assert per_token("gspo", inputs) == pytest.approx([1.0, 1.0, E(0.05)])
    # log ratio 12 on every token, cap 10: rho = e^10 and no gradient through the cap
    loss, grad, metrics = summed_grad("gspo", make_inputs([11.0, 11.0], [-1.0, -1.0], old=[-1.0, -1.0], seq=[0, 0]))
    assert loss == pytest.approx(E(10.0))
    assert grad == pytest.approx([0.0, 0.0])
    assert metrics["ratio_max"] == pytest.approx(E(10.0))


# ---------------------------------------------------------------- gradient direction (all losses)


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_gradient_pushes_logprob_along_advantage(name, advantage):
    # on-policy start (r = 1, w = 1): descending the loss raises l for A > 0, lowers it for A < 0
    lps = [-2.0, -0.7, -1.3, -0.4]
    inputs = make_inputs(lps, [advantage] * 4, mask=[0.0, 1.0, 1.0, 1.0], seq=[0] * 4)
    _, grad, _ = summed_grad(name, inputs)
    assert grad[0] == 0.0
    for g in grad[1:]:
        assert g * advantage < 0, (name, grad)


# ---------------------------------------------------------------- aggregation


def _two_sequence_inputs() -> LossInputs:
    # importance_sampling with r = 1, w = 1 gives L = -A: seq0 one trainable token (A = 2),
    # seq1 three trainable tokens (A = -1); prompt tokens masked
    return make_inputs([-1.0] * 6, [2.0, 2.0, -1.0, -1.0, -1.0, -1.0], mask=[0, 1, 0, 1, 1, 1], seq=[0, 0, 1, 1, 1, 1])


@pytest.mark.parametrize(
    "aggregation,expected",
    [("sum", -2.0 + 3.0), ("token_mean", (-2.0 + 3.0) / 4), ("sequence_mean", (-2.0 / 1 + 3.0 / 3) / 2)],
)
def test_aggregation_modes(aggregation, expected):
    cfg = LossConfig(policy_loss="importance_sampling", aggregation=aggregation)
    loss, metrics = compute_policy_loss(_two_sequence_inputs(), cfg, total_tokens=4, total_sequences=2)
    assert loss.item() == pytest.approx(expected)
    assert metrics["loss"] == pytest.approx(expected)


def test_step_wide_denominators_scale_a_micro_batch():
    cfg = LossConfig(policy_loss="importance_sampling", aggregation="token_mean")
    loss, _ = compute_policy_loss(_two_sequence_inputs(), cfg, total_tokens=10, total_sequences=5)
    assert loss.item() == pytest.approx(1.0 / 10)


def test_masked_positions_never_reach_the_loss_even_as_nan():
    def nan_outside_mask(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
        loss_N = -inputs.logprobs_N * inputs.advantages_N
        return LossOutput(torch.where(inputs.loss_mask_N > 0, loss_N, torch.full_like(loss_N, float("nan"))), {})

    for aggregation in ("sum", "token_mean", "sequence_mean"):
        inputs = _two_sequence_inputs()
        cfg = LossConfig(policy_loss=nan_outside_mask, aggregation=aggregation)
        loss, _ = compute_policy_loss(inputs, cfg, total_tokens=4, total_sequences=2)
        loss.backward()
        assert math.isfinite(loss.item())
        assert torch.isfinite(inputs.logprobs_N.grad).all()


def _random_sequences(seed: int) -> list[dict[str, list[float]]]:
    gen = torch.Generator().manual_seed(seed)
    sequences = []
    for length, adv in [(3, 1.3), (5, -0.7), (2, 0.4)]:
        old = (-torch.rand(length, generator=gen, dtype=torch.float64) * 2).tolist()
        lps = [o + 0.3 * float(torch.randn(1, generator=gen, dtype=torch.float64)) for o in old]
        sampler = [o + 0.5 * float(torch.randn(1, generator=gen, dtype=torch.float64)) for o in old]
        ref = [o + 0.2 * float(torch.randn(1, generator=gen, dtype=torch.float64)) for o in old]
        mask = [0.0] + [1.0] * (length - 1)
        sequences.append(dict(lps=lps, old=old, sampler=sampler, ref=ref, mask=mask, adv=[adv] * length))
    return sequences


def _pack(sequences: list[dict[str, list[float]]]) -> LossInputs:
    cat = {k: [v for s in sequences for v in s[k]] for k in sequences[0]}
    seq = [i for i, s in enumerate(sequences) for _ in s["lps"]]
    return make_inputs(
        cat["lps"], cat["adv"], old=cat["old"], sampler=cat["sampler"], mask=cat["mask"], seq=seq, ref=cat["ref"]
    )


@pytest.mark.parametrize("name", ALL_LOSSES)
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean", "sum"])
def test_micro_batch_accumulation_equals_whole_batch(name, aggregation):
    sequences = _random_sequences(seed=7)
    cfg = LossConfig(policy_loss=name, aggregation=aggregation, kl_beta=0.1, dual_clip=2.0)
    total_tokens = sum(int(sum(s["mask"])) for s in sequences)
    whole = _pack(sequences)
    whole_loss, _ = compute_policy_loss(whole, cfg, total_tokens, total_sequences=3)
    whole_loss.backward()

    micro_losses, micro_grads = [], []
    for part in (sequences[:2], sequences[2:]):
        micro = _pack(part)
        loss, _ = compute_policy_loss(micro, cfg, total_tokens, total_sequences=3)
        loss.backward()
        micro_losses.append(loss.item())
        micro_grads.append(micro.logprobs_N.grad)
    assert sum(micro_losses) == pytest.approx(whole_loss.item(), rel=1e-12, abs=1e-12)
    assert torch.allclose(torch.cat(micro_grads), whole.logprobs_N.grad, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------- bad input


def test_bad_inputs_name_the_field():
    cfg = LossConfig()
    inputs = make_inputs([-1.0, -1.0], [1.0, 1.0])
    inputs.advantages_N = inputs.advantages_N[:1]
    with pytest.raises(ValueError, match="advantages_N"):
        compute_policy_loss(inputs, cfg, 2, 2)
    inputs = make_inputs([-1.0, -1.0], [1.0, 1.0])
    inputs.num_sequences = 1
    with pytest.raises(ValueError, match="sequence_index_N"):
        compute_policy_loss(inputs, cfg, 2, 2)
    with pytest.raises(ValueError, match="total_tokens"):
        compute_policy_loss(make_inputs([-1.0, -1.0], [1.0, 1.0]), cfg, 1, 2)
    with pytest.raises(ValueError, match="total_sequences"):
        compute_policy_loss(make_inputs([-1.0, -1.0], [1.0, 1.0]), cfg, 2, 1)
    inputs = make_inputs([-1.0], [1.0])
    inputs.loss_mask_N = inputs.loss_mask_N.long()
    with pytest.raises(ValueError, match="loss_mask_N"):
        compute_policy_loss(inputs, cfg, 1, 1)


def test_metrics_always_include_tis_mismatch_and_loss():
    for name in ALL_LOSSES:
        _, metrics = compute_policy_loss(_pack(_random_sequences(seed=1)), LossConfig(policy_loss=name), 7, 3)
        assert {"tis_weight_mean", "tis_clip_fraction", "mismatch_kl", "loss", "kl_ref"} <= set(metrics), name
        assert all(isinstance(v, float) and math.isfinite(v) for v in metrics.values()), name
        assert metrics["ratio_max"] >= metrics["ratio_mean"]


# ---------------------------------------------------------------- tiny optimisation per loss


@pytest.mark.parametrize("name", ALL_LOSSES)
def test_optimising_each_loss_raises_the_positive_sequences_logprob(name):
    torch.manual_seed(0)
    vocab, length = 5, 4
    logits = torch.nn.Parameter(torch.randn(2 * length, vocab, dtype=torch.float64))
    tokens = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])
    sequence_index = torch.tensor([0] * length + [1] * length)
    mask = torch.tensor([0.0, 1, 1, 1] * 2, dtype=torch.float64)
    advantages = torch.tensor([1.0] * length + [-1.0] * length, dtype=torch.float64)
    cfg = LossConfig(policy_loss=name)
    optimizer = torch.optim.SGD([logits], lr=0.5)

    def token_logprobs() -> torch.Tensor:
        return torch.log_softmax(logits, dim=-1)[torch.arange(2 * length), tokens]

    def sequence_logprob(index: int) -> float:
        with torch.no_grad():
            return float((token_logprobs() * mask)[sequence_index == index].sum())

    sampler = token_logprobs().detach()
    start_pos, start_neg = sequence_logprob(0), sequence_logprob(1)
    for _ in range(30):
        logprobs = token_logprobs()
        inputs = LossInputs(logprobs, logprobs.detach(), sampler, advantages, mask, sequence_index, 2)
        loss, _ = compute_policy_loss(inputs, cfg, total_tokens=6, total_sequences=2)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert sequence_logprob(0) > start_pos + 0.5, name
    assert sequence_logprob(1) < start_neg - 0.5, name


def test_sample_weights_scale_each_sequences_contribution():
    """A sequence of weight 0 contributes no gradient; weight 2 counts twice."""
    from training.utils.rl.losses import compute_policy_loss
    from training.utils.rl.losses.common import LossInputs
    from training.utils.rl.losses.config import LossConfig

    def run(weights):
        lp = torch.tensor([-1.0, -1.0, -2.0, -2.0], requires_grad=True)
        inputs = LossInputs(
            logprobs_N=lp,
            old_logprobs_N=lp.detach().clone(),
            sampler_logprobs_N=lp.detach().clone(),
            advantages_N=torch.tensor([1.0, 1.0, -1.0, -1.0]),
            loss_mask_N=torch.ones(4),
            sequence_index_N=torch.tensor([0, 0, 1, 1]),
            num_sequences=2,
            sample_weights_N=None if weights is None else torch.tensor(weights),
        )
        loss, _ = compute_policy_loss(inputs, LossConfig(policy_loss="importance_sampling", kl_beta=0.0), 4, 2)
        loss.backward()
        return lp.grad

    base = run(None)
    assert torch.equal(run([1.0, 1.0, 1.0, 1.0]), base)
    g = run([0.0, 0.0, 2.0, 2.0])
    assert torch.all(g[:2] == 0) and torch.allclose(g[2:], 2 * base[2:])
