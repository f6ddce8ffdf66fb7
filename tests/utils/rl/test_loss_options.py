"""Loss options against hand-written formulas in float64: every (loss, aggregation) pair (value and gradient),
masked importance sampling at each level (value, gradient, fraction masked), the clip fraction per side."""

from __future__ import annotations

import math

import pytest
import torch

from training.utils.rl.losses import LOSSES, LossConfig, LossInputs, compute_policy_loss
from training.utils.rl.losses.config import AGGREGATIONS

# three sequences: a prompt token (mask 0) then trainable tokens; ratios off 1 (some clipped), sampler off the
# old logprobs (TIS weights != 1, one over the cap), mixed-sign advantages
LOGPROBS = [-1.0, -0.7, -1.5, -0.2, -2.0, -0.9, -1.6, -0.4, -1.1]
OLD = [-1.0, -1.0, -1.2, -0.5, -2.0, -1.0, -1.0, -0.5, -1.0]
SAMPLER = [-1.0, -1.1, -1.0, -2.5, -2.0, -0.8, -1.3, -0.45, -0.9]
REF = [-1.0, -0.9, -1.3, -0.3, -2.0, -1.2, -1.1, -0.6, -1.0]
ADVANTAGES = [0.0, 1.5, 1.5, 1.5, 0.0, -0.8, -0.8, 0.6, 0.6]
MASK = [0, 1, 1, 1, 0, 1, 1, 1, 1]
SEQ = [0, 0, 0, 0, 1, 1, 1, 2, 2]
KL_BETA, DUAL_CLIP, CONSTANT, TIS_CAP, DRO_BETA = 0.1, 2.0, 7.0, 5.0, 0.05


def f64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def make_inputs(sampler=SAMPLER, old=OLD) -> LossInputs:
    return LossInputs(
        logprobs_N=f64(LOGPROBS).requires_grad_(True),
        old_logprobs_N=f64(old),
        sampler_logprobs_N=f64(sampler),
        advantages_N=f64(ADVANTAGES),
        loss_mask_N=f64(MASK),
        sequence_index_N=torch.tensor(SEQ, dtype=torch.long),
        num_sequences=max(SEQ) + 1,
        ref_logprobs_N=f64(REF),
    )


def hand_per_token(name: str, l: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each loss's L_t written out token by token (losses/README.md), differentiable in the scalars ``l``."""
    out = []
    for t in range(len(l)):
        a, old, s, ref = ADVANTAGES[t], OLD[t], SAMPLER[t], REF[t]
        r = torch.exp(l[t] - old)
        w = min(math.exp(old - s), TIS_CAP)
        if name == "grpo":
            pg = torch.maximum(-r * a, -r.clamp(0.8, 1.2) * a) * w
            out.append(pg + KL_BETA * (torch.exp(ref - l[t]) - (ref - l[t]) - 1))
        elif name == "importance_sampling":
            out.append(-r * a * w)
        elif name == "reinforce":
            out.append(-torch.exp(l[t] - s) * a)
        elif name == "dapo":
            surrogate = torch.maximum(-r * a, -r.clamp(0.8, 1.28) * a)
            if a < 0:
                surrogate = torch.minimum(torch.tensor(-DUAL_CLIP * a, dtype=torch.float64), surrogate)
            out.append(surrogate * w)
        elif name == "dro":
            out.append(-(l[t] * a * w - 0.5 * DRO_BETA * (l[t] - old) ** 2))
        elif name == "gspo":
            mine = [u for u in range(len(l)) if SEQ[u] == SEQ[t] and MASK[u]]
            seq_log_ratio = sum(float(l[u].detach()) - OLD[u] for u in mine) / len(mine)
            rho = torch.exp(l[t] - l[t].detach() + seq_log_ratio)
            out.append(torch.maximum(-rho * a, -rho.clamp(0.8, 1.2) * a) * w)
        elif name == "cispo":
            out.append(-float(r.detach().clamp(0.8, 1.28)) * l[t] * a * w)
        else:
            raise AssertionError(f"no hand formula for the loss {name!r}: write one here")
    return out


def hand_aggregate(per_token: list[torch.Tensor], aggregation: str, keep=None) -> torch.Tensor:
    """The step loss of ``per_token`` written out (masked tokens and masked-IS tokens contribute 0)."""
    kept = [m * (1 if keep is None else keep[t]) for t, m in enumerate(MASK)]
    sequences = sorted(set(SEQ))
    seq_sums = [sum(per_token[t] * kept[t] for t in range(len(SEQ)) if SEQ[t] == q) for q in sequences]
    seq_counts = [sum(MASK[t] for t in range(len(SEQ)) if SEQ[t] == q) for q in sequences]
    total = sum(seq_sums)
    if aggregation == "token_mean":
        return total / sum(MASK)
    if aggregation == "sequence_mean":
        return sum(x / n for x, n in zip(seq_sums, seq_counts)) / len(sequences)
    if aggregation == "sequence_mean_token_sum":
        return total / len(sequences)
    if aggregation == "constant":
        return total / (len(sequences) * CONSTANT)
    if aggregation == "sum":
        return total
    raise AssertionError(f"no hand aggregation for {aggregation!r}: write one here")


def config(name: str, aggregation: str, **kwargs) -> LossConfig:
    return LossConfig(
        policy_loss=name,
        aggregation=aggregation,
        aggregation_constant=CONSTANT,
        kl_beta=KL_BETA,
        dual_clip=DUAL_CLIP if name == "dapo" else None,
        tis_cap=TIS_CAP,
        dro_beta=DRO_BETA,
        **kwargs,
    )


def hand_value_and_grad(name: str, aggregation: str, keep=None) -> tuple[float, list[float]]:
    l = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in LOGPROBS]
    loss = hand_aggregate(hand_per_token(name, l), aggregation, keep)
    loss.backward()
    return float(loss.detach()), [float(x.grad) if x.grad is not None else 0.0 for x in l]


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("name", sorted(LOSSES))
def test_every_loss_under_every_aggregation_matches_its_hand_formula(name, aggregation):
    """Value and gradient of the step loss equal the hand-written L_t reduced by the hand-written aggregation."""
    inputs = make_inputs()
    loss, metrics = compute_policy_loss(inputs, config(name, aggregation), sum(MASK), inputs.num_sequences)
    loss.backward()
    expected, expected_grad = hand_value_and_grad(name, aggregation)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert inputs.logprobs_N.grad.tolist() == pytest.approx(expected_grad, rel=1e-10, abs=1e-12)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert any(g != 0.0 for g in expected_grad)  # the case has a gradient to compare


def test_aggregation_modes_differ_on_this_batch():
    """The five aggregations give five different values here, so the test above can tell them apart."""
    values = {a: hand_value_and_grad("importance_sampling", a)[0] for a in AGGREGATIONS}
    assert len({round(v, 12) for v in values.values()}) == len(AGGREGATIONS)


def test_constant_aggregation_needs_its_constant():
    with pytest.raises(ValueError, match="aggregation_constant"):
        LossConfig(aggregation="constant")
    with pytest.raises(ValueError, match="aggregation_constant"):
        LossConfig(aggregation="constant", aggregation_constant=0.0)


# ---------------------------------------------------------------- masked importance sampling

# d = l_old - l_s per token; the default bounds are [1/2, 2]
D = [o - s for o, s in zip(OLD, SAMPLER)]


def hand_keep(level: str, low: float, high: float) -> list[int]:
    """Which tokens masked IS keeps, from the d = l_old - l_s of the module's lists, by hand."""
    if level == "token":
        return [int(low <= math.exp(d) <= high) for d in D]
    keep = []
    for t in range(len(D)):
        mine = [D[u] for u in range(len(D)) if SEQ[u] == SEQ[t] and MASK[u]]
        log_ratio = sum(mine) if level == "sequence" else sum(mine) / len(mine)
        keep.append(int(low <= math.exp(log_ratio) <= high))
    return keep


@pytest.mark.parametrize(
    "level,low,high,masked_tokens,masked_sequences",
    [
        # token ratios exp(d) on trainable tokens: e^.1, e^-.2, e^2 | e^-.2, e^.3 | e^-.05, e^-.1 → e^2 leaves [.5, 2]
        ("token", None, 2.0, [3], [0]),
        # sums of d: seq0 .1-.2+2 = 1.9 (out), seq1 .1, seq2 -.15
        ("sequence", None, 2.0, [1, 2, 3], [0]),
        # means of d: seq0 1.9/3 = .633 (e^.633 = 1.88, in [.5, 2]); with high 1.5 it is out, and a low of .95
        # also drops seq2 (e^-.075 = .928)
        ("geometric", None, 2.0, [], []),
        ("geometric", 0.95, 1.5, [1, 2, 3, 7, 8], [0, 2]),
    ],
)
def test_masked_importance_sampling_masks_tokens_outside_the_bounds(level, low, high, masked_tokens, masked_sequences):
    cfg = config("importance_sampling", "token_mean", mis_level=level, mis_low=low, mis_high=high)
    lo, hi = cfg.mis_bounds
    keep = hand_keep(level, lo, hi)
    assert [t for t in range(len(keep)) if MASK[t] and not keep[t]] == masked_tokens  # the case is what it says
    inputs = make_inputs()
    loss, metrics = compute_policy_loss(inputs, cfg, sum(MASK), inputs.num_sequences)
    loss.backward()
    expected, expected_grad = hand_value_and_grad("importance_sampling", "token_mean", keep)
    assert loss.item() == pytest.approx(expected, rel=1e-12, abs=1e-12)
    assert inputs.logprobs_N.grad.tolist() == pytest.approx(expected_grad, rel=1e-10, abs=1e-12)
    for t in masked_tokens:
        assert inputs.logprobs_N.grad[t] == 0.0
    assert metrics["mis_masked_fraction"] == pytest.approx(len(masked_tokens) / sum(MASK))
    assert metrics["mis_masked_sequence_fraction"] == pytest.approx(len(masked_sequences) / 3)


def test_masked_importance_sampling_is_off_by_default():
    inputs = make_inputs()
    loss, metrics = compute_policy_loss(inputs, LossConfig(policy_loss="importance_sampling"), sum(MASK), 3)
    assert "mis_masked_fraction" not in metrics
    assert loss.item() == pytest.approx(hand_value_and_grad("importance_sampling", "token_mean")[0], rel=1e-12)


def test_masked_importance_sampling_bounds_are_checked():
    with pytest.raises(ValueError, match="mis_level"):
        LossConfig(mis_level="soft")
    with pytest.raises(ValueError, match="mis_high"):
        LossConfig(mis_level="token", mis_high=0.9)
    with pytest.raises(ValueError, match="mis_low"):
        LossConfig(mis_level="token", mis_low=1.5)
    assert LossConfig(mis_high=4.0).mis_bounds == (0.25, 4.0)


# ---------------------------------------------------------------- clip fraction per side


def test_clip_fraction_is_logged_per_side():
    """grpo, eps 0.2: r = 0.5 with A < 0 is clipped at the lower bound, r = 1.5 with A > 0 at the upper, r = 1.5
    with A < 0 and r = 0.5 with A > 0 are not clipped (the unclipped branch is the pessimistic one)."""
    ratios, advantages = [0.5, 1.5, 1.5, 0.5, 1.0], [-1.0, 1.0, -1.0, 1.0, 1.0]
    n = len(ratios)
    inputs = LossInputs(
        logprobs_N=f64([-1.0 + math.log(r) for r in ratios]).requires_grad_(True),
        old_logprobs_N=f64([-1.0] * n),
        sampler_logprobs_N=f64([-1.0] * n),
        advantages_N=f64(advantages),
        loss_mask_N=f64([1.0] * n),
        sequence_index_N=torch.arange(n),
        num_sequences=n,
    )
    _, metrics = compute_policy_loss(inputs, LossConfig(policy_loss="grpo", kl_beta=0.0), n, n)
    assert metrics["clip_fraction_low"] == pytest.approx(1 / 5)
    assert metrics["clip_fraction_high"] == pytest.approx(1 / 5)
    assert metrics["clip_fraction"] == pytest.approx(2 / 5)


def hand_kl(estimator: str, l: torch.Tensor, ref: float) -> torch.Tensor:
    d = l - ref
    return {"k1": d, "k2": d * d / 2, "k3": torch.exp(-d) + d - 1}[estimator]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_each_kl_estimator_adds_its_hand_formula_to_grpo_and_all_three_are_logged(estimator):
    """grpo with kl_beta β minus grpo without the penalty = β · token_mean of the estimator, value and gradient."""
    with_kl, without = make_inputs(), make_inputs()
    loss, metrics = compute_policy_loss(
        with_kl, config("grpo", "token_mean", kl_estimator=estimator), sum(MASK), with_kl.num_sequences
    )
    plain = LossConfig(policy_loss="grpo", kl_beta=0.0, tis_cap=TIS_CAP)
    base, _ = compute_policy_loss(without, plain, sum(MASK), without.num_sequences)
    loss.backward()
    base.backward()
    l = [torch.tensor(v, dtype=torch.float64, requires_grad=True) for v in LOGPROBS]
    penalty = KL_BETA * sum(m * hand_kl(estimator, x, r) for x, r, m in zip(l, REF, MASK)) / sum(MASK)
    penalty.backward()
    assert (loss - base).item() == pytest.approx(penalty.item(), rel=1e-12)
    got = (with_kl.logprobs_N.grad - without.logprobs_N.grad).tolist()
    assert got == pytest.approx([float(x.grad) for x in l], rel=1e-10, abs=1e-12)
    for name in ("k1", "k2", "k3"):
        mean = sum(
            m * float(hand_kl(name, torch.tensor(x, dtype=torch.float64), r)) for x, r, m in zip(LOGPROBS, REF, MASK)
        ) / sum(MASK)
        assert metrics[f"kl_ref_{name}"] == pytest.approx(mean, rel=1e-12)
    assert metrics["kl_ref"] == metrics[f"kl_ref_{estimator}"]


def test_an_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="kl_estimator"):
        LossConfig(kl_estimator="k4")
