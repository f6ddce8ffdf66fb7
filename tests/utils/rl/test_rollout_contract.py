"""The rollout contract rejects every malformed sample with an error naming the field."""

import math

import pytest

from training.utils.rl.rollout import RolloutRun, RolloutSample, RolloutValidationError, flatten_result, validate_sample


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


def test_numpy_and_torch_scalar_rewards_are_accepted_as_floats():
    """Issue #31: a reward computed with numpy or torch was refused as "not a finite number"."""
    import numpy as np
    import torch

    for reward in (np.float32(0.5), np.float64(0.5), torch.tensor(0.5), torch.tensor([0.5]), np.array(0.5)):
        (sample,) = flatten_result(good(reward=reward))
        assert type(sample.reward) is float and sample.reward == 0.5
    run = RolloutRun(segments=[good()], reward=np.int64(2))
    assert flatten_result(run)[0].reward == 2.0 and type(run.reward) is float


@pytest.mark.parametrize(
    "reward, says",
    [
        (None, "None (NoneType) is not a number"),
        ({"score": 1.0}, "(dict) is not a number"),
        ("1.0", "(str) is not a number"),
        (True, "(bool) is not a number"),
        (1e200, "out of range: |reward| must be <= MAX_ABS_REWARD"),
        (-1e7, "out of range"),
    ],
)
def test_a_reward_that_is_not_a_bounded_number_is_refused_naming_the_field(reward, says):
    """Issue #29 / #31: None crashed with a raw TypeError; 1e200 passed and overflowed the advantages."""
    from training.utils.rl.rollout import MAX_ABS_REWARD

    with pytest.raises(RolloutValidationError) as e:
        flatten_result(good(reward=reward))
    assert e.value.field == "reward" and says in str(e.value)
    with pytest.raises(RolloutValidationError, match="reward"):
        flatten_result(RolloutRun(segments=[good()], reward=reward))
    flatten_result(good(reward=MAX_ABS_REWARD))  # the bound itself is allowed


def test_a_dict_result_is_refused_as_the_rollout_result_with_a_hint():
    from training.utils.rl.rollout import result_reward

    for check in (flatten_result, result_reward):
        with pytest.raises(RolloutValidationError) as e:
            check({"tokens": [1, 2], "reward": 1.0})
        assert e.value.field == "rollout result" and "got dict" in str(e.value)
    assert result_reward(None) is None and result_reward(good(reward=0.25)) == 0.25


def test_a_plain_function_or_a_non_callable_is_refused_as_rollout_fn():
    """Issue #31: a `def` rollout_fn printed an asyncio message once per rollout; it is refused at start."""
    import functools

    from training.utils.rl.rollout import check_rollout_fn

    async def rollout_fn(row):
        return None

    def sync_rollout_fn(row):
        return None

    class Agent:
        async def __call__(self, row):
            return None

    for ok in (rollout_fn, functools.partial(rollout_fn), Agent(), lambda row: rollout_fn(row)):
        check_rollout_fn(ok)
    with pytest.raises(TypeError, match=r"sync_rollout_fn is a plain `def`; declare it `async def sync_rollout_fn"):
        check_rollout_fn(sync_rollout_fn)
    with pytest.raises(TypeError, match="returned NoneType, not a function"):
        check_rollout_fn(None)
