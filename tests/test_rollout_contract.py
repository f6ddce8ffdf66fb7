"""The rollout contract rejects every malformed sample with an error naming the field."""

import math

import pytest

from training.utils.rl.rollout import RolloutRun, RolloutSample, RolloutValidationError, flatten_result, validate_sample

pytestmark = pytest.mark.unit


def good(**kw):
    base = dict(tokens=[5, 6, 7, 8], logprobs=[0.0, 0.0, -0.5, -1.0], loss_mask=[0, 0, 1, 1], reward=1.0)
    base.update(kw)
    return RolloutSample(**base)


def test_valid_sample_passes():
    validate_sample(good(), vocab_size=10)
    validate_sample(good(token_weight_versions=[3, 4]), vocab_size=10)
    assert good().num_trainable_tokens == 2


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(logprobs=[0.0, -1.0]), "logprobs"),
        (dict(loss_mask=[0, 1]), "loss_mask"),
        (dict(loss_mask=[0, 2, 1, 1]), "loss_mask"),
        (dict(loss_mask=[0, 0, 0, 0]), "loss_mask"),
        (dict(loss_mask=[1, 0, 1, 1]), "loss_mask"),
        (dict(reward=float("nan")), "reward"),
        (dict(reward=math.inf), "reward"),
        (dict(logprobs=[0.0, 0.0, float("nan"), -1.0]), "logprobs"),
        (dict(logprobs=[0.0, 0.0, -math.inf, -1.0]), "logprobs"),
        (dict(tokens=[5, 6, 70, 8]), "tokens"),
        (dict(tokens=[5, -1, 7, 8]), "tokens"),
        (dict(tokens=[], logprobs=[], loss_mask=[]), "tokens"),
        (dict(token_weight_versions=[0, 0, 0, 0]), "token_weight_versions"),  # one per trainable token, not per token
        (dict(token_weight_versions=[0, -1]), "token_weight_versions"),
    ],
)
def test_malformed_sample_names_field(kw, field):
    with pytest.raises(RolloutValidationError) as e:
        validate_sample(good(**kw), vocab_size=10)
    assert e.value.field == field
    assert str(e.value).startswith(field)


def test_wrong_type_is_rejected():
    with pytest.raises(RolloutValidationError, match="expected RolloutSample"):
        flatten_result({"tokens": [1]})


def test_run_segments_share_the_run_reward():
    run = RolloutRun(segments=[good(reward=0.0), good(reward=5.0)], reward=0.25)
    samples = flatten_result(run, vocab_size=10)
    assert [s.reward for s in samples] == [0.25, 0.25]


def test_empty_run_and_none():
    assert flatten_result(None) == []
    with pytest.raises(RolloutValidationError, match="segments"):
        flatten_result(RolloutRun(segments=[], reward=1.0))


@pytest.mark.parametrize("weight", [-1.0, float("nan")])
def test_bad_sample_weight_is_rejected(weight):
    with pytest.raises(RolloutValidationError) as e:
        validate_sample(good(weight=weight))
    assert e.value.field == "weight"


def test_segment_rewards_keep_each_segments_own_reward():
    run = RolloutRun(segments=[good(reward=0.0), good(reward=5.0)], reward=1.0, segment_rewards=True)
    assert [s.reward for s in flatten_result(run)] == [0.0, 5.0]
