"""Multi-reward: named reward components checked at the contract, combined per group against a hand computation,
logged per step and in rollouts.jsonl, and trained in a run."""

from __future__ import annotations

import json
import logging
import math
import re
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest

from training.recipes import async_rl_loop
from training.recipes.step_metrics import batch_metrics
from training.utils.config import ConfigError
from training.utils.metrics import read_metrics
from training.utils.rl import reward_components as rc
from training.utils.rl.failure_log import FailureLog
from training.utils.rl.groups import PromptGroup
from training.utils.rl.reward_components import apply_reward_components, combine_components, component_metrics
from training.utils.rl.rollout import RolloutRun, RolloutSample, RolloutValidationError, flatten_result
from tests.recipes.test_recipes import config as recipes_config


def sample(reward: float = 0.0, components=None) -> RolloutSample:
    return RolloutSample(
        tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], reward=reward, reward_components=components
    )


def group(*components, rewards=None) -> PromptGroup:
    g = PromptGroup(position=0, row={"id": "q-1"}, submit_version=0, row_index=4)
    for k, c in enumerate(components):
        r = rewards[k] if rewards else 0.0
        g.samples.append(sample(r, c))
        g.completion_index.append(k)
        g.completion_rewards[k] = r
        if c is not None:
            g.completion_components[k] = dict(c)
    return g


def hand_normalised(values: list[float]) -> list[float]:
    """(r - mean) / (unbiased std + 1e-4), written out."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    return [(v - mean) / (std + 1e-4) for v in values]


CORRECT = [1.0, 0.0, 1.0]
FORMAT = [0.2, 0.8, 0.5]


def test_combination_is_the_weighted_sum_of_group_normalised_components():
    components = [{"correct": c, "format": f} for c, f in zip(CORRECT, FORMAT)]
    got = combine_components(components, {"correct": 1.0, "format": 0.5})
    # correct: mean 2/3, std sqrt(1/3); format: mean 0.5, std 0.3
    s1, s2 = math.sqrt(1 / 3) + 1e-4, 0.3 + 1e-4
    hand = [(1 / 3) / s1 + 0.5 * -0.3 / s2, (-2 / 3) / s1 + 0.5 * 0.3 / s2, (1 / 3) / s1 + 0.0]
    assert got == pytest.approx(hand, rel=1e-12)
    assert got == pytest.approx(
        [a + 0.5 * b for a, b in zip(hand_normalised(CORRECT), hand_normalised(FORMAT))], rel=1e-12
    )
    # a component equal across the group adds nothing (GDPO: no spread, no signal)
    flat = [{"correct": c, "same": 3.0} for c in CORRECT]
    assert combine_components(flat, {"correct": 2.0, "same": 5.0}) == pytest.approx(
        [2 * z for z in hand_normalised(CORRECT)]
    )


def test_weighted_group_trains_on_the_combination_and_the_estimator_runs_on_top():
    g = group(*[{"correct": c, "format": f} for c, f in zip(CORRECT, FORMAT)], rewards=[9.0, 9.0, 9.0])
    assert apply_reward_components(g, {"correct": 1.0, "format": 0.5})
    combined = [a + 0.5 * b for a, b in zip(hand_normalised(CORRECT), hand_normalised(FORMAT))]
    assert g.rewards == pytest.approx(combined) and [s.reward for s in g.samples] == g.rewards
    g.compute_advantages("grpo")  # grpo normalises the combined rewards again
    assert g.advantages == pytest.approx(hand_normalised(combined))
    assert g.completion_components[1] == {"correct": 0.0, "format": 0.8}  # logged as returned


def test_without_weights_the_returned_reward_trains_and_components_are_only_logged():
    g = group({"a": 1.0, "b": 2.0}, {"a": 3.0, "b": 4.0}, rewards=[0.5, 0.25])
    assert apply_reward_components(g, None)
    assert g.rewards == [0.5, 0.25]
    other = group({"a": 5.0, "b": 0.0}, {"a": 7.0, "b": 0.0})
    m = batch_metrics([g, other])
    assert m["rollout/reward/a_mean"] == 4.0 and m["rollout/reward/b_mean"] == 1.5
    assert component_metrics([group(None, None)]) == {}


def test_a_component_without_a_weight_counts_zero_and_is_warned_about_once(caplog, monkeypatch):
    monkeypatch.setattr(rc, "_warned_unweighted", set())
    components = [{"correct": c, "format": f} for c, f in zip(CORRECT, FORMAT)]
    with caplog.at_level(logging.WARNING, logger="training.utils.rl.reward_components"):
        got = combine_components(components, {"correct": 1.0})
        combine_components(components, {"correct": 1.0})
    assert got == pytest.approx(hand_normalised(CORRECT))
    assert [r.getMessage() for r in caplog.records].count(
        "reward component 'format' has no weight in reward_weights: it counts with weight 0 (logged only)"
    ) == 1


@pytest.mark.parametrize(
    "components, weights, expected",
    [
        ([{"a": 1.0}, {"a": 0.0}], {"a": 1.0, "b": 1.0}, r"reward_weights names \['b'\]"),
        ([None, None], {"a": 1.0}, r"reward_weights names \['a'\].*return reward_components none"),
        ([{"a": 1.0}, {"b": 0.0}], None, r"completion 0 returns \['a'\], completion 1 \['b'\]"),
        ([{"a": 1.0}, None], {"a": 1.0}, r"completion 0 returns \['a'\], completion 1 none"),
    ],
)
def test_a_group_breaking_the_rules_is_invalid_naming_the_row_and_the_names(caplog, components, weights, expected):
    g = group(*components)
    with caplog.at_level(logging.WARNING, logger="training.rollout"):
        assert not apply_reward_components(g, weights, FailureLog())
    assert not g.samples and not g.completion_rewards  # nothing of it trains
    assert g.invalid == 2 and g.failure_causes == {"invalid_reward_components": 2} and g.attempts == 2
    (message,) = [r.getMessage() for r in caplog.records]
    assert "data row 4 (id 'q-1')" in message
    assert re.search(expected, message)


def test_per_call_credit_keeps_each_segments_per_call_part():
    g = group({"a": 1.0}, {"a": 0.0}, rewards=[1.0, 0.0])
    g.samples[0].reward = 0.5 * 1.0 + 0.25  # g_s = 0.5, per-call reward 0.25
    g.return_weights = [0.5, 1.0]
    assert apply_reward_components(g, {"a": 2.0})
    r0, r1 = [2 * z for z in hand_normalised([1.0, 0.0])]
    assert g.rewards == pytest.approx([r0, r1])
    assert g.samples[0].reward == pytest.approx(0.5 * r0 + 0.25) and g.samples[1].reward == pytest.approx(r1)


def test_the_contract_checks_each_component_like_a_reward():
    s = sample(1.0, {"correct": np.float32(1.0), "format": 2})
    flatten_result(s)
    assert s.reward_components == {"correct": 1.0, "format": 2.0}
    assert all(type(v) is float for v in s.reward_components.values())
    for bad, match in [
        ({"format": float("nan")}, r"reward_components\['format'\]: nan is not a finite number"),
        ({"format": 1e9}, r"reward_components\['format'\]: .*MAX_ABS_REWARD"),
        ({"format": None}, r"reward_components\['format'\]: None"),
        ({"a/b": 1.0}, r"reward_components: name 'a/b' is not a metric-safe string"),
        ({}, "reward_components: {} is not a non-empty dict"),
        ([1.0], r"reward_components: \[1.0\] is not a non-empty dict"),
    ]:
        with pytest.raises(RolloutValidationError, match=match) as e:
            flatten_result(sample(1.0, bad))
        assert e.value.field.startswith("reward_components")


def test_a_runs_components_are_the_completions_and_reach_every_segment():
    run = RolloutRun(segments=[sample(), sample()], reward=0.7, reward_components={"a": 1})
    assert [s.reward_components for s in flatten_result(run)] == [{"a": 1.0}, {"a": 1.0}]
    clash = RolloutRun(segments=[sample(), sample(0.0, {"b": 1.0})], reward=0.7, reward_components={"a": 1.0})
    with pytest.raises(RolloutValidationError, match="segment 1 carries its own"):
        flatten_result(clash)


def test_reward_weights_are_checked_and_recorded_only_when_set():
    for bad in ({}, {"a": float("inf")}, {"a b": 1.0}, {"a": True}, [("a", 1.0)]):
        with pytest.raises(ConfigError, match="reward_weights"):
            async_rl_loop.Config(base_model="m", reward_weights=bad)
    assert "reward_weights" not in async_rl_loop.Config(base_model="m").to_dict()  # runs recorded before resume
    assert async_rl_loop.Config(base_model="m", reward_weights={"a": 1}).to_dict()["reward_weights"] == {"a": 1}


def test_a_run_logs_each_component_and_trains_on_the_hand_combination(tiny_model_path, embedded_server, tmp_path):
    """Each completion returns two weighted components and one unweighted; every trained reward in rollouts.jsonl
    equals the hand combination of its group's components, and the step metrics have each component's mean."""
    server = embedded_server(max_batch_size=16)

    def make_rollout_fn(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs, ignore_eos=True)

        async def rollout_fn(row):
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            out = c.full_tokens[c.prompt_len :]
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(out),
                reward=100.0,  # replaced by the combination
                reward_components={
                    "odd": sum(t % 2 for t in out) / len(out),
                    "first": float(out[0] % 5),
                    "length": float(len(out)),
                },
            )

        return rollout_fn

    rows = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(8)]
    weights = {"odd": 1.0, "first": 0.25}
    cfg = recipes_config(
        tiny_model_path, server, tmp_path, max_steps=1, completions_per_prompt=3, reward_weights=weights
    )
    async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
    lines = [json.loads(line) for line in (Path(cfg.log_path) / "rollouts.jsonl").read_text().splitlines()]
    assert len(lines) == 6 and all(set(r["reward_components"]) == {"odd", "first", "length"} for r in lines)
    assert any(abs(r["reward"]) > 0.1 for r in lines)  # the combination, not the returned 100.0 nor all zeros
    by_group = defaultdict(list)
    for r in lines:
        by_group[r["row_position"]].append(r)
    for members in by_group.values():
        members.sort(key=lambda r: r["completion"])
        expected = [0.0] * len(members)
        for name, w in weights.items():
            values = [r["reward_components"][name] for r in members]
            if max(values) > min(values):
                expected = [e + w * z for e, z in zip(expected, hand_normalised(values))]
        assert [r["reward"] for r in members] == pytest.approx(expected, abs=1e-9)
    m = read_metrics(cfg.log_path)[0]
    for name in ("odd", "first", "length"):
        assert m[f"rollout/reward/{name}_mean"] == pytest.approx(
            sum(r["reward_components"][name] for r in lines) / len(lines)
        )
    assert m["rollout/reward_mean"] == pytest.approx(sum(r["reward"] for r in lines) / len(lines))
