"""A loss's aggregation is decided once (``loss_aggregation(cfg)``): the PPO step's sample-weight normalisation
and ``compute_policy_loss``'s reduction read the same one, for every registered loss and a user callable."""

from __future__ import annotations

import pytest
import torch

from training.trainer.packing import pack_sequences
from training.utils.rl import ppo
from training.utils.rl.losses import LOSSES, LossConfig, LossInputs, LossOutput, compute, loss_aggregation
from training.utils.rl.losses.config import AGGREGATIONS
from training.utils.rl.ppo import StepBatch, train_on_batch


class PackingTrainer:
    """The trainer's side of ``train_on_batch`` without a model: the real packing, logprobs 0 (with gradient)."""

    def forward_backward(self, sequences, loss_fn, temperature=1.0):
        total, metrics = 0.0, {}
        for packed in pack_sequences(sequences, max_tokens=4096):
            logprobs_N = torch.zeros(packed.num_tokens, requires_grad=True)
            loss, metrics = loss_fn(packed, logprobs_N)
            loss.backward()
            total += float(loss.detach())
        return {**metrics, "loss": total}

    def optim_step(self):
        return {"grad_norm": 0.0, "learning_rate": 0.0}


def weighted_batch() -> StepBatch:
    """Two samples: 2 and 4 trainable tokens, advantages 1 and -2, weights 0.5 and 1."""
    return StepBatch(
        tokens=[[1, 2, 3, 4], [1, 5, 6, 7, 8, 9]],
        sampler_logprobs=[[0.0, 0.0, -1.0, -1.0], [0.0, 0.0, -1.0, -1.0, -1.0, -1.0]],
        loss_masks=[[0, 0, 1, 1], [0, 0, 1, 1, 1, 1]],
        advantages=[1.0, -2.0],
        weights=[0.5, 1.0],
    )


def advantage_loss(inputs: LossInputs, cfg: LossConfig) -> LossOutput:
    """L_t = A_t (plus 0·l so it has a gradient): the step loss is then the weighted mean of the advantages."""
    return LossOutput(inputs.advantages_N + 0.0 * inputs.logprobs_N)


def test_a_loss_output_carries_no_aggregation_of_its_own():
    """A second, run-time declaration would be read after the weights were normalised for the first."""
    with pytest.raises(TypeError, match="aggregation"):
        LossOutput(torch.zeros(2), aggregation="sequence_mean")


@pytest.mark.parametrize("aggregation,expected", [("token_mean", -1.4), ("sequence_mean", -1.0)])
def test_a_user_loss_is_weighted_and_reduced_by_its_configured_aggregation(aggregation, expected):
    """token_mean: sum_i w_i·T_i·A_i / sum_i w_i·T_i = (0.5·2·1 + 4·(-2)) / 5; sequence_mean:
    sum_i w_i·A_i / sum_i w_i = (0.5 - 2) / 1.5 (each mixed with the other's weighting gives neither)."""
    cfg = LossConfig(policy_loss=advantage_loss, aggregation=aggregation, kl_beta=0.0, tis_level="off")
    out = train_on_batch(PackingTrainer(), weighted_batch(), cfg)
    assert out["train/loss"] == pytest.approx(expected)


@pytest.mark.parametrize("configured", AGGREGATIONS)
@pytest.mark.parametrize("name", [*sorted(LOSSES), "callable"])
def test_weighting_and_reduction_read_one_aggregation(name, configured, monkeypatch):
    """For every registered loss and a callable, under every configured aggregation, the weights are normalised
    for, and the loss reduced with, ``loss_aggregation(cfg)``."""
    seen = {"weights": [], "reduce": []}
    normalise, reduce = ppo.normalised_weights, compute.aggregate

    def spy_normalise(weights, tokens, aggregation):
        seen["weights"].append(aggregation)
        return normalise(weights, tokens, aggregation)

    def spy_reduce(per_token_loss_N, inputs, aggregation, total_tokens, total_sequences, constant=None):
        seen["reduce"].append(aggregation)
        return reduce(per_token_loss_N, inputs, aggregation, total_tokens, total_sequences, constant)

    monkeypatch.setattr(ppo, "normalised_weights", spy_normalise)
    monkeypatch.setattr(compute, "aggregate", spy_reduce)
    policy_loss = advantage_loss if name == "callable" else name
    cfg = LossConfig(policy_loss=policy_loss, aggregation=configured, aggregation_constant=8.0, kl_beta=0.0)
    train_on_batch(PackingTrainer(), weighted_batch(), cfg)
    decided = loss_aggregation(cfg)
    assert seen == {"weights": [decided], "reduce": [decided]}
    assert decided == configured  # a given aggregation applies to every loss, gspo included
    unset = loss_aggregation(LossConfig(policy_loss=policy_loss, kl_beta=0.0))
    own = None if name == "callable" else LOSSES[name].aggregation
    assert unset == (own or "token_mean")  # left unset: the registered loss's own (gspo: sequence_mean)
