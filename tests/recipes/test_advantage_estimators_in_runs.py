"""The advantage estimator, a given aggregation and masked importance sampling through both recipes on the tiny
model and the real embedded server: the groups a step trains carry the estimator's advantages (checked by hand
from their rewards), and the masked fraction and the clip fractions per side are logged every step."""

from __future__ import annotations

import statistics

import pytest

from training.recipes import async_rl_loop, rl_loop
from training.recipes import context as recipes_context
from training.utils import LossConfig
from training.utils.metrics import read_metrics
from training.utils.rl.advantages import STD_EPSILON
from tests.recipes.test_recipes import config as recipes_config
from training.utils.rl.rollout import RolloutSample

ROWS = [{"id": i, "prompt_ids": [1, 10 + i % 50, 20 + i % 7, 201]} for i in range(16)]


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server(fresh=True, max_batch_size=16)  # the recipes push their weights to it


def make_rollout_fn(setup):
    sampler = setup.sampler.with_defaults(**setup.sampling_kwargs)

    async def rollout_fn(row):
        (c,) = await sampler.sample_with_prompt_tokens(row["prompt_ids"], n=1)
        out = c.full_tokens[c.prompt_len :]
        return RolloutSample(
            tokens=c.full_tokens,
            logprobs=[0.0] * c.prompt_len + c.inference_logprobs,
            loss_mask=[0] * c.prompt_len + [1] * len(out),
            reward=sum(t % 3 for t in out) / len(out),  # varies between completions of a row
        )

    return rollout_fn


def spy_advantages(monkeypatch) -> list[list[tuple[list[float], list[float]]]]:
    """Per step, each trained group's (rewards per sample, advantages) as the trainer received them."""
    steps = []
    real = recipes_context.train_on_groups

    def spy(trainer, groups, *a, **kw):
        steps.append([([g.completion_rewards[k] for k in g.completion_index], list(g.advantages)) for g in groups])
        return real(trainer, groups, *a, **kw)

    monkeypatch.setattr(recipes_context, "train_on_groups", spy)
    return steps


def hand_advantages(estimator: str, step: list[tuple[list[float], list[float]]]) -> list[float]:
    out = []
    for rewards, _ in step:
        mean, n = sum(rewards) / len(rewards), len(rewards)
        if max(rewards) == min(rewards):
            out += [0.0] * n
        elif estimator == "rloo":
            out += [r - (sum(rewards) - r) / (n - 1) for r in rewards]
        else:
            out += [r - mean for r in rewards]
    if estimator == "reinforce_pp" and len(set(out)) > 1:
        out = [a / (statistics.stdev(out) + STD_EPSILON) for a in out]
    return out


@pytest.mark.parametrize(
    "recipe,estimator,aggregation",
    [(async_rl_loop, "reinforce_pp", "constant"), (rl_loop, "rloo", "sequence_mean_token_sum")],
)
def test_a_run_trains_the_estimators_advantages_and_logs_the_masks(
    tiny_model_path, server, tmp_path, monkeypatch, recipe, estimator, aggregation
):
    steps = spy_advantages(monkeypatch)
    cfg = recipes_config(  # one Config class serves both recipes
        tiny_model_path,
        server,
        tmp_path,
        completions_per_prompt=3,
        advantage=estimator,
        loss=LossConfig(
            kl_beta=0.0, aggregation=aggregation, aggregation_constant=4.0, mis_level="geometric", mis_high=1.5
        ),
        ppo_mini_batches=2,
    )
    out = recipe.main(cfg, rollout_fn_factory=make_rollout_fn, rows=ROWS)
    assert out["steps"] == 2 and len(steps) == 2
    for step in steps:
        got = [a for _, advantages in step for a in advantages]
        assert got == pytest.approx(hand_advantages(estimator, step), rel=1e-12, abs=1e-12)
    assert any(a != 0.0 for step in steps for _, adv in step for a in adv)  # the case has signal
    m = [r for r in read_metrics(cfg.log_path) if "train/loss" in r]
    assert len(m) == 2
    for r in m:  # the embedded engine matches the trainer: nothing leaves [1/1.5, 1.5]
        assert r["train/mis_masked_fraction"] == 0.0 and r["train/mis_masked_sequence_fraction"] == 0.0
        assert 0.0 <= r["train/clip_fraction_low"] <= r["train/clip_fraction"] <= 1.0
        assert r["train/clip_fraction_low"] + r["train/clip_fraction_high"] == pytest.approx(r["train/clip_fraction"])
