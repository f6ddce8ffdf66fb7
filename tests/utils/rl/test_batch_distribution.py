"""The step's advantage distribution and sampled-token entropy, against hand computations (``unit``)."""

import math

import pytest

from training.utils.rl.ppo import StepBatch, batch_distribution_metrics


def test_advantage_distribution_and_sampled_entropy_over_trainable_tokens():
    batch = StepBatch(
        tokens=[[1, 2, 3, 4], [1, 2, 3], [1, 2, 3]],
        sampler_logprobs=[[0.0, -1.0, -2.0, -3.0], [0.0, -0.5, -0.5], [0.0, -4.0, -4.0]],
        loss_masks=[[0, 1, 1, 1], [0, 1, 1], [0, 0, 1]],
        advantages=[1.5, [0.0, -1.0, 2.0], 0.0],
        weights=[1.0, 1.0, 1.0],
    )
    m = batch_distribution_metrics(batch)
    values = [1.5, 1.5, 1.5, -1.0, 2.0, 0.0]  # the scalar once per trainable token, the list on its mask
    mean = sum(values) / 6
    assert m["train/advantage_mean"] == pytest.approx(mean)
    assert m["train/advantage_std"] == pytest.approx(math.sqrt(sum((v - mean) ** 2 for v in values) / 6))
    assert (m["train/advantage_min"], m["train/advantage_max"]) == (-1.0, 2.0)
    assert m["train/advantage_zero_fraction"] == pytest.approx(1 / 3)  # the third sample: no learning signal
    assert m["train/sampled_entropy"] == pytest.approx((1 + 2 + 3 + 0.5 + 0.5 + 4) / 6)


def test_a_batch_without_trainable_tokens_reports_nothing():
    empty = StepBatch(
        tokens=[[1, 2]], sampler_logprobs=[[0.0, -1.0]], loss_masks=[[0, 0]], advantages=[1.0], weights=[1.0]
    )
    assert batch_distribution_metrics(empty) == {}
