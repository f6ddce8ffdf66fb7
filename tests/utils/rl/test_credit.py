"""Per-call credit: AIR survives equal returns, the discounted baseline is consistent, tool status is
read from structure first, and transitions train with the same weight per episode as stitching."""

import asyncio

import pytest

from training.proxy import make_proxy_rollout_fn, with_tool_status
from training.utils.rl.rollout.turn_matching import assign
from training.proxy.records import CallRecord, SessionRecord
from training.proxy.transitions import (
    build_transitions,
    credit_parts,
    discounted,
    tool_result_status,
    tool_status_counts,
)
from training.utils.rl.advantages import credited_advantages
from training.utils.rl.groups import failure_cause, run_group
from training.utils.rl.ppo import StepBatch, normalised_weights, train_on_batch
from training.utils.rl.rollout import RolloutRun, RolloutSetup

USER = {"role": "user", "content": "2 + 3?"}


def tool_episode(failed: bool) -> list[CallRecord]:
    """One episode: a calculator call, its result (an error or 5), then an answer."""
    call = {"id": "t1", "type": "function", "function": {"name": "calc", "arguments": '{"e": "2+3"}'}}
    c1 = CallRecord(
        index=-1,
        endpoint="chat",
        agent="default",
        prompt_ids=[1, 2],
        output_ids=[3],
        output_logprobs=[-0.1],
        finish_reason="tool_calls",
        weight_version=0,
        upstream="u",
        messages=[USER],
        response_message={"role": "assistant", "content": None, "tool_calls": [call]},
    )
    result = {"role": "tool", "tool_call_id": "t1", "content": "ValueError: bad expression" if failed else "5"}
    c2 = CallRecord(
        index=-1,
        endpoint="chat",
        agent="default",
        prompt_ids=[1, 2, 3, 4],
        output_ids=[5],
        output_logprobs=[-0.2],
        finish_reason="stop",
        weight_version=0,
        upstream="u",
        messages=[USER, c1.response_message, result],
        response_message={"role": "assistant", "content": "7"},
    )
    session = SessionRecord("s")
    for c in (c1, c2):
        assign(session, c)
    return session.calls


def group_of(runs):
    """``run_group`` over prepared results (the recipe's own grouping), advantages computed."""
    pending = list(runs)

    async def rollout_fn(row):
        return pending.pop(0)

    group = asyncio.run(run_group(rollout_fn, {}, 0, 0, len(runs), 10.0, asyncio.Semaphore(1)))
    group.compute_advantages()
    return group


def transitions_run(calls, reward, credit_fn):
    res = build_transitions(calls, reward, credit_fn)
    return RolloutRun(res.samples, reward, segment_rewards=True, return_weights=res.return_weights)


def test_air_changes_advantages_in_an_all_failed_group():
    """Four failed episodes (return 0); only the first made a broken tool call."""
    credit = with_tool_status(failed_call=-0.5)
    group = group_of([transitions_run(tool_episode(failed=k == 0), 0.0, credit) for k in range(4)])
    assert [s.reward for s in group.samples] == [-0.5, 0.0] + [0.0, 0.0] * 3
    mean_i = -0.5 / 8
    assert group.advantages == pytest.approx([-0.5 - mean_i] + [-mean_i] * 7)
    assert group.advantages[0] < 0 < group.advantages[1]  # the broken call is pushed down, the others up


def test_air_in_stitch_mode_enters_the_run_reward():
    class Sampler:
        base_url, api_key = "http://127.0.0.1:9", None

    fn = make_proxy_rollout_fn(
        lambda row, ep: "",
        reward_fn=lambda row, answer: 0.0,
        mode="stitch",
        credit_fn=with_tool_status(failed_call=-0.5),
    )(RolloutSetup(Sampler(), None))
    runs = []
    for k in range(4):
        session = SessionRecord(f"s{k}")
        session.calls = tool_episode(failed=k == 0)
        runs.append(asyncio.run(fn.episode_result({}, "", session)))
    assert [r.reward for r in runs] == [-0.5, 0.0, 0.0, 0.0]
    assert runs[0].metadata["tool_status_counts"] == {"error": 1} and runs[1].metadata["labels"]["APPEND"] == 1
    group = group_of(runs)
    assert group.advantages[0] < 0 < group.advantages[-1]


def test_discounted_baseline_does_not_push_down_the_successful_runs_first_call():
    """Returns 0 and 1 over three calls each, gamma 0.5: A = g·(R - mean R)/std, never below 0 for R = 1."""
    calls = tool_episode(failed=False) + tool_episode(failed=False)[:1]
    group = group_of([transitions_run(calls, r, discounted(0.5)) for r in (0.0, 1.0)])
    episode = 0.5 / (0.5**0.5 + 1e-4)  # (1 - 0.5) / (unbiased std of [0, 1] + 1e-4)
    expected = [-0.25 * episode, -0.5 * episode, -episode, 0.25 * episode, 0.5 * episode, episode]
    assert group.advantages == pytest.approx(expected)
    # the undiscounted baseline gave [-0.707, -0.707, -0.707, -0.354, 0.0, 0.707]
    assert min(group.advantages[3:]) > 0


def test_credited_advantages_without_per_call_credit_are_plain_grpo():
    rewards_G = [0.0, 1.0, 1.0, 0.5]
    plain = credited_advantages(rewards_G, [0, 1, 1, 2, 3], [0.0, 1.0, 1.0, 1.0, 0.5], [1.0] * 5)
    std = (sum((r - 0.625) ** 2 for r in rewards_G) / 3) ** 0.5
    assert plain == pytest.approx([(r - 0.625) / (std + 1e-4) for r in (0.0, 1.0, 1.0, 1.0, 0.5)])
    assert credited_advantages([1.0, 1.0], [0, 1], [1.0, 1.0], [1.0, 1.0]) == [0.0, 0.0]


def test_credit_parts_reads_affine_credit_and_refuses_the_rest():
    calls = tool_episode(failed=True)
    calls[1].posted_rewards.append(0.25)
    shares, intermediate = credit_parts(with_tool_status(discounted(0.5), failed_call=-0.5), calls, 2.0)
    assert shares == [0.5, 1.0] and intermediate == [-0.5, 0.25]
    with pytest.raises(ValueError, match="not affine"):
        credit_parts(lambda cs, r: [r * r] * len(cs), calls, 2.0)
    with pytest.raises(ValueError, match="returned 1 rewards for 2 calls"):
        credit_parts(lambda cs, r: [r], calls, 2.0)


@pytest.mark.parametrize(
    "content, status",
    [
        ('{"error": null, "value": 5}', "ok"),
        ('{"error": "division by zero"}', "error"),
        ({"status": "failed"}, "error"),
        ('{"ok": false}', "error"),
        ("[1, 2]", "ok"),
        ("ValueError: bad expression", "error"),
        ("Traceback (most recent call last):", "error"),
        ("error: no such item", "error"),
        ("No errors found", "ok"),
        ("Errors: 0", "ok"),
        ("42", "ok"),
        ([{"type": "text", "text": '{"is_error": true}'}], "error"),
    ],
)
def test_tool_status_comes_from_structure_then_text(content, status):
    assert tool_result_status(content) == status


def test_tool_status_counts_per_episode():
    calls = tool_episode(failed=True)
    calls[1].response_message = {"role": "assistant", "content": '<tool_call>{"name": broken</tool_call>'}
    assert tool_status_counts(calls) == {"error": 1, "unparsable": 1}


def test_failure_causes_are_named():
    from training.proxy.rollout import AgentFailedError, UpstreamFailedError

    class Status(RuntimeError):
        status = 503

    assert [
        failure_cause(e)
        for e in (
            AgentFailedError("x", cause="agent_KeyError"),
            UpstreamFailedError("x"),
            asyncio.TimeoutError(),
            Status(),
            ConnectionResetError(),
            KeyError("k"),
        )
    ] == ["agent_keyerror", "upstream", "timeout", "upstream_5xx", "connection", "exception_keyerror"]


def test_normalised_weights_make_a_weighted_mean():
    w = normalised_weights([0.5, 0.5, 1.0], [4, 6, 3], "token_mean")
    assert sum(x * t for x, t in zip(w, [4, 6, 3])) == pytest.approx(13)  # sum w'T = sum T
    assert w[0] / w[2] == pytest.approx(0.5)
    assert sum(normalised_weights([0.5, 0.5, 1.0], [4, 6, 3], "sequence_mean")) == pytest.approx(3)
    assert normalised_weights([0.0, 0.0], [1, 1], "token_mean") == [0.0, 0.0]


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_transitions_and_stitch_train_with_equal_weight_per_episode(tiny_model_path, aggregation):
    """Two episodes of two calls: stitched (one sample each) and as transitions (weight 1/2 each) give
    the same loss and gradient (without the weight normalisation, transitions would train at half strength)."""
    from training.trainer import PolicyTrainer
    from training.utils.config import TrainerConfig
    from training.utils.rl.losses.config import LossConfig

    episodes = [
        ([5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15], 1.0),
        ([5, 20, 21], [22, 23, 24], [25, 26], [27, 28, 29], -0.5),
    ]
    stitch, trans = StepBatch([], [], [], [], []), StepBatch([], [], [], [], [])
    for p1, o1, glue, o2, adv in episodes:
        tokens = p1 + o1 + glue + o2
        mask = [0] * len(p1) + [1] * len(o1) + [0] * len(glue) + [1] * len(o2)
        stitch.tokens.append(tokens), stitch.loss_masks.append(mask), stitch.advantages.append(adv)
        stitch.sampler_logprobs.append([-1.0 if m else 0.0 for m in mask]), stitch.weights.append(1.0)
        for seq, m in ((p1 + o1, mask[: len(p1 + o1)]), (tokens, [0] * len(p1 + o1 + glue) + [1] * len(o2))):
            trans.tokens.append(seq), trans.loss_masks.append(m), trans.advantages.append(adv)
            trans.sampler_logprobs.append([-1.0 if x else 0.0 for x in m]), trans.weights.append(0.5)
    cfg = LossConfig(policy_loss="grpo", kl_beta=0.0, aggregation=aggregation, tis_level="off")
    out = [
        train_on_batch(PolicyTrainer(tiny_model_path, TrainerConfig(device="cpu", learning_rate=1e-3)), batch, cfg)
        for batch in (stitch, trans)
    ]
    assert abs(out[0]["train/loss"]) > 1e-4
    assert out[1]["train/loss"] == pytest.approx(out[0]["train/loss"], rel=1e-4)
    assert out[1]["train/grad_norm"] == pytest.approx(out[0]["train/grad_norm"], rel=1e-4)
