"""DAPO's overlong shaping: the soft length penalty against its formula, the truncation filter, and both in a run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from training.recipes import async_rl_loop
from training.utils.config import ConfigError
from training.utils.metrics import read_metrics
from training.utils.rl.groups import PromptGroup
from training.utils.rl.overlong import OverlongConfig, apply_overlong, length_penalty
from training.utils.rl.rollout import RolloutSample
from tests.recipes.test_recipes import config as recipes_config


def sample(generated: int, reward: float, finish_reason: str = "stop") -> RolloutSample:
    return RolloutSample(
        tokens=[1, 2] + [5] * generated,
        logprobs=[0.0] * (2 + generated),
        loss_mask=[0, 0] + [1] * generated,
        reward=reward,
        finish_reason=finish_reason,
    )


def group(*samples: RolloutSample) -> PromptGroup:
    g = PromptGroup(position=0, row={"id": 0}, submit_version=0)
    for k, s in enumerate(samples):
        g.samples.append(s)
        g.completion_index.append(k)
        g.completion_rewards[k] = s.reward
    return g


def test_length_penalty_is_zero_then_linear_over_the_buffer_then_minus_one():
    # L_max = 20, L_c = 8: 0 up to 12, (12 - L) / 8 on (12, 20], -1 past 20
    assert [length_penalty(n, 20, 8) for n in (5, 12, 13, 16, 20, 21)] == [0.0, 0.0, -0.125, -0.5, -1.0, -1.0]
    assert [length_penalty(n, 20, 0) for n in (20, 21)] == [0.0, -1.0]  # no buffer: only past L_max


def test_apply_overlong_shapes_rewards_and_filters_truncated_completions():
    g = group(sample(4, 1.0), sample(16, 1.0), sample(25, 0.5, "length"))
    assert apply_overlong(g, OverlongConfig(max_tokens=20, buffer_tokens=8, penalty=2.0)) == 0
    assert g.rewards == [1.0, 1.0 - 2.0 * 0.5, 0.5 - 2.0] and [s.reward for s in g.samples] == g.rewards
    g = group(sample(4, 1.0), sample(16, 1.0), sample(25, 0.5, "length"))
    assert apply_overlong(g, OverlongConfig(filter_truncated=True)) == 1
    assert g.rewards == [1.0, 1.0] and len(g.samples) == 2 and g.completion_index == [0, 1]
    assert g.overlong_filtered == 1 and g.attempts == 3  # still an attempt, not a failure
    g.compute_advantages()
    assert g.advantages == [0.0, 0.0]  # the filtered completion is not in the baseline either
    untouched = group(sample(30, 1.0, "length"))
    assert apply_overlong(untouched, OverlongConfig()) == 0 and untouched.rewards == [1.0]


def test_a_run_of_several_segments_keeps_its_per_call_part():
    """Two segments of one completion (no per-call credit: r_s = R, g_s = 1) and another completion: shaping moves
    every segment with the return, so the advantages carry no call part (before: r_s - R' = the penalty did)."""
    g = group(sample(2, 1.0), sample(10, 0.0))
    g.samples.insert(1, sample(6, 1.0))
    g.completion_index = [0, 0, 1]
    apply_overlong(g, OverlongConfig(max_tokens=6, buffer_tokens=2))  # completion 0: 8 tokens, past L_max
    assert g.rewards == [0.0, -1.0] and [s.reward for s in g.samples] == [0.0, 0.0, -1.0]
    g.compute_advantages()
    assert g.advantages[0] == g.advantages[1] and g.advantages[0] > 0 > g.advantages[2]


@pytest.mark.parametrize(
    "kw, field",
    [({"max_tokens": 0}, "overlong.max_tokens"), ({"max_tokens": 8, "buffer_tokens": 8}, "overlong.buffer_tokens")],
)
def test_bad_overlong_settings_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=field):
        OverlongConfig(**kw)


def test_a_run_trains_on_length_shaped_rewards(tiny_model_path, embedded_server, tmp_path):
    """Sampling max_tokens=4 with EOS ignored: every completion is 4 tokens, past overlong.max_tokens=3, so each
    trained reward is its rollout's reward minus penalty (0.5)."""
    server = embedded_server(max_batch_size=16)
    returned = []

    def make_rollout_fn(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs, ignore_eos=True)

        async def rollout_fn(row):
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            out = c.full_tokens[c.prompt_len :]
            returned.append(float(sum(t % 2 for t in out)))
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * len(out),
                reward=returned[-1],
                finish_reason=c.finish_reason,
            )

        return rollout_fn

    rows = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(8)]
    overlong = OverlongConfig(max_tokens=3, buffer_tokens=1, penalty=0.5)
    cfg = recipes_config(tiny_model_path, server, tmp_path, max_steps=1, overlong=overlong)
    assert (
        cfg.to_dict()["overlong"]["max_tokens"] == 3
        and "overlong" not in recipes_config(tiny_model_path, server, tmp_path).to_dict()
    )  # recorded only when set: runs recorded before it resume
    async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
    trained = [json.loads(line) for line in (Path(cfg.log_path) / "rollouts.jsonl").read_text().splitlines()]
    assert len(trained) == 4 and all(r["trainable_tokens"] == 4 for r in trained)
    assert not Counter(r["reward"] + 0.5 for r in trained) - Counter(returned)  # each is a returned reward - 0.5
    assert read_metrics(cfg.log_path)[0]["rollout/overlong_filtered"] == 0


def test_a_run_whose_every_completion_is_cut_off_and_filtered_stops_with_one_line(
    tiny_model_path, embedded_server, tmp_path
):
    from training.recipes.context import RolloutFailureError

    server = embedded_server(max_batch_size=16)

    def make_rollout_fn(setup):
        sampler = setup.sampler.with_defaults(**setup.sampling_kwargs, ignore_eos=True)

        async def rollout_fn(row):
            (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
            n = len(c.full_tokens) - c.prompt_len
            return RolloutSample(
                tokens=c.full_tokens,
                logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
                loss_mask=[0] * c.prompt_len + [1] * n,
                reward=1.0,
                finish_reason=c.finish_reason,
            )

        return rollout_fn

    rows = [{"id": i, "prompt_ids": [1, 10 + i, 20 + i % 7, 201]} for i in range(16)]
    cfg = recipes_config(tiny_model_path, server, tmp_path, overlong=OverlongConfig(filter_truncated=True))
    with pytest.raises(RolloutFailureError, match="cut off for length"):
        async_rl_loop.main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
