"""Turn matching, stitching and transitions on hand-built call records (no server)."""

import pytest

from training.utils.rl.rollout.turn_matching import assign, classify, message_hash
from training.proxy.records import APPEND, NEW, WIPE, CallRecord, SessionRecord
from training.proxy.stitching import stitch_calls
from training.proxy.transitions import build_transitions, discounted, episode_weights, with_tool_status
from training.utils.rl.rollout import validate_sample

SYS = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "2 + 3?"}


def call(prompt, output, messages=None, reply=None, agent="default", tools=None, finish="stop"):
    return CallRecord(
        index=-1,
        endpoint="chat" if messages is not None else "completions",
        agent=agent,
        prompt_ids=list(prompt),
        output_ids=list(output),
        output_logprobs=[-0.1 * (i + 1) for i in range(len(output))],
        finish_reason=finish,
        weight_version=0,
        upstream="u",
        messages=messages,
        tools=tools,
        response_message=reply,
    )


def run_session(calls, strategy="messages"):
    s = SessionRecord("s")
    for c in calls:
        assign(s, c, strategy)
    return s


def test_message_hash_ignores_sdk_noise_and_tool_call_ids():
    a = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1, "y": 2}'}}
        ],
    }
    b = {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "audio": None,
        "tool_calls": [
            {"id": "call_999", "type": "function", "function": {"name": "calc", "arguments": '{"y": 2, "x": 1}'}}
        ],
    }
    assert message_hash(a) == message_hash(b)
    assert message_hash(a) != message_hash({**b, "tool_calls": [{"function": {"name": "calc", "arguments": "{}"}}]})


def test_messages_strategy_labels_append_thinking_compaction_and_hash_change():
    r1 = {"role": "assistant", "content": "<think>add</think>5"}
    c1 = call([1, 2, 3], [7, 8], [SYS, USER], r1)
    c2 = call(
        [1, 2, 3, 7, 8, 9, 4],
        [10],
        [SYS, USER, r1, {"role": "user", "content": "sure?"}],
        {"role": "assistant", "content": "yes"},
    )
    c3 = call(
        [1, 2, 5],
        [11],
        [SYS, {"role": "user", "content": "earlier: 5"}, {"role": "user", "content": "ok"}],
        {"role": "assistant", "content": "ok"},
    )
    c4 = call([1, 6], [12], [SYS, {"role": "user", "content": "summary: 5"}], {"role": "assistant", "content": "k"})
    c5 = call(
        [1, 6, 12, 9, 3],
        [13],
        [
            SYS,
            {"role": "user", "content": "CHANGED"},
            {"role": "assistant", "content": "k"},
            {"role": "user", "content": "more"},
        ],
        {"role": "assistant", "content": "m"},
    )
    s = run_session([c1, c2, c3, c4, c5])
    kinds = [k for k, _ in s.labels()]
    assert kinds == [NEW, APPEND, WIPE, WIPE, WIPE]
    reasons = [r for _, r in s.labels()]
    assert reasons[1] == "prompt extends previous call"
    assert reasons[2] == "context compacted: 5 messages expected, 3 sent (first change at index 1)"
    assert reasons[3] == "context compacted: 4 messages expected, 2 sent (first change at index 1)"
    assert reasons[4] == "message hash changed at index 1 (role 'user')"
    assert [c.label.chain for c in s.calls] == [0, 0, 1, 2, 3]
    # thinking stripped: the same history, but the <think> block removed from the assistant turn
    stripped = call(
        [1, 2, 3, 5], [9], [SYS, USER, {"role": "assistant", "content": "5"}, {"role": "user", "content": "sure?"}]
    )
    label = classify(c1, stripped)
    assert (label.kind, label.reason) == (WIPE, "thinking stripped at index 2")


def test_tools_change_and_token_drift_are_reported():
    tools = [{"type": "function", "function": {"name": "calc"}}]
    c1 = call([1, 2], [3, 4], [USER], {"role": "assistant", "content": "x"}, tools=tools)
    follow = [USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    assert classify(c1, call([1, 2, 3, 4, 5], [6], follow, tools=None)).reason == "tools changed"
    drift = classify(c1, call([1, 2, 3, 9, 5], [6], follow, tools=tools))
    assert drift.kind == APPEND and drift.token_drift and drift.token_prefix == 3
    assert "token prefix broken at position 3 of 4" in drift.reason


def test_token_strategy_is_strict_prefix():
    c1 = call([1, 2], [3, 4], [USER], {"role": "assistant", "content": "x"})
    follow = [USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    ok = classify(c1, call([1, 2, 3, 4, 5], [6], follow), "tokens")
    bad = classify(c1, call([1, 2, 3, 9, 5], [6], follow), "tokens")
    assert (ok.kind, bad.kind, bad.reason) == (APPEND, WIPE, "token prefix broken at position 3")
    with pytest.raises(ValueError, match="strategy"):
        classify(c1, c1, "fuzzy")


def test_agents_get_separate_chains():
    a1 = call([1, 2], [3], agent="solver")
    b1 = call([5, 6], [7], agent="critic")
    a2 = call([1, 2, 3, 4], [8], agent="solver")
    s = run_session([a1, b1, a2], "tokens")
    assert [c.label.kind for c in s.calls] == [NEW, NEW, APPEND]
    assert s.calls[2].label.chain == s.calls[0].label.chain != s.calls[1].label.chain


def test_stitch_append_chain_masks_exactly_the_outputs():
    c1 = call([1, 2, 3], [7, 8])
    c2 = call([1, 2, 3, 7, 8, 9, 4], [10, 11])
    s = run_session([c1, c2], "tokens")
    res = stitch_calls(s.calls, reward=1.0)
    [seg] = res.samples
    validate_sample(seg)
    assert seg.tokens == [1, 2, 3, 7, 8, 9, 4, 10, 11]
    assert seg.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    assert [lp for lp, m in zip(seg.logprobs, seg.loss_mask) if m] == c1.output_logprobs + c2.output_logprobs
    assert res.segment_calls == [[0, 1]] and res.drift_events == []


def test_stitch_drift_is_split_or_masked_never_shifted():
    c1 = call([1, 2, 3], [7, 8], [USER], {"role": "assistant", "content": "x"})
    c2 = call(
        [1, 2, 3, 7, 99, 9], [10], [USER, {"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}]
    )
    s = run_session([c1, c2])
    assert s.calls[1].label.token_drift
    split = stitch_calls(s.calls, on_drift="split")
    assert [x.tokens for x in split.samples] == [[1, 2, 3, 7, 8], [1, 2, 3, 7, 99, 9, 10]]
    assert [x.loss_mask for x in split.samples] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 0, 1]]
    assert split.drift_events == [{"call": 1, "position": 4, "expected_len": 5, "action": "split"}]
    masked = stitch_calls(s.calls, on_drift="mask")
    [seg] = masked.samples
    assert seg.tokens == [1, 2, 3, 7, 99, 9, 10] and seg.loss_mask == [0, 0, 0, 1, 0, 0, 1]
    assert seg.logprobs[3] == c1.output_logprobs[0] and seg.logprobs[4] == 0.0


def test_stitch_truncates_over_length_and_drops_empty_segments():
    s = run_session([call([1, 2, 3], [7, 8, 9]), call([4, 5, 6, 7], [])], "tokens")
    res = stitch_calls(s.calls, max_seq_len=4)
    [seg] = res.samples
    assert seg.tokens == [1, 2, 3, 7] and seg.finish_reason == "length" and res.dropped_segments == 1


def test_stitched_and_transition_samples_carry_each_generated_tokens_weight_version():
    c1 = call([1, 2, 3], [7, 8, 9])
    c1.token_weight_versions = [4, 4, 5]  # an in-flight update landed during this call
    c2 = call([1, 2, 3, 7, 8, 9, 4], [10, 11])
    c2.weight_version = 5  # an upstream that reports one version per call
    s = run_session([c1, c2], "tokens")
    [seg] = stitch_calls(s.calls).samples
    validate_sample(seg)
    assert seg.token_weight_versions == [4, 4, 5, 5, 5]
    [masked] = stitch_calls(s.calls, on_drift="mask", max_seq_len=5).samples  # cut inside c1's output
    assert masked.token_weight_versions == [4, 4]
    first, second = build_transitions(s.calls, 1.0, max_seq_len=8).samples  # the second call is cut to 1 token
    validate_sample(second)
    assert first.token_weight_versions == [4, 4, 5] and second.token_weight_versions == [5]


def test_transitions_credit_functions_and_episode_weights():
    c1 = call(
        [1],
        [2],
        [USER],
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "t1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}],
        },
    )
    c2 = call(
        [1, 2, 3],
        [4],
        [USER, c1.response_message, {"role": "tool", "tool_call_id": "t1", "content": "error: bad expression"}],
        {"role": "assistant", "content": 'oops <tool_call>{"name": broken</tool_call>'},
    )
    c3 = call([5], [6], [USER], {"role": "assistant", "content": "42"})
    calls = run_session([c1, c2, c3]).calls
    same = build_transitions(calls, 1.0)
    assert same.rewards == [1.0, 1.0, 1.0] and same.weights == pytest.approx([1 / 3] * 3)
    assert [x.loss_mask for x in same.samples] == [[0, 1], [0, 0, 0, 1], [0, 1]]
    assert build_transitions(calls, 1.0, discounted(0.5)).rewards == [0.25, 0.5, 1.0]
    shaped = build_transitions(calls, 1.0, with_tool_status(failed_call=-0.3, unparsable_call=-0.2))
    assert shaped.rewards == pytest.approx([0.7, 0.8, 1.0])
    assert episode_weights(0) == [] and sum(episode_weights(7)) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="credit_fn returned 1 rewards for 3 calls"):
        build_transitions(calls, 1.0, lambda cs, r: [r])


def test_interleaved_conversations_each_extend_their_own_call():
    """One agent name, two conversations taking turns: each call APPENDs to its own conversation's call."""
    a1 = call([1, 2], [3], [SYS, USER], {"role": "assistant", "content": "a"})
    b1 = call([1, 5], [6], [SYS, {"role": "user", "content": "other"}], {"role": "assistant", "content": "b"})
    a2 = call(
        [1, 2, 3, 4],
        [7],
        [SYS, USER, {"role": "assistant", "content": "a"}, {"role": "user", "content": "?"}],
        {"role": "assistant", "content": "a2"},
    )
    b2 = call(
        [1, 5, 6, 4],
        [8],
        [
            SYS,
            {"role": "user", "content": "other"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "?"},
        ],
        {"role": "assistant", "content": "b2"},
    )
    s = run_session([a1, b1, a2, b2])
    assert [c.label.kind for c in s.calls] == [NEW, WIPE, APPEND, APPEND]
    assert s.calls[2].label.reason == "prompt extends call 0" and s.calls[2].label.parent == 0
    assert [c.label.chain for c in s.calls] == [0, 1, 0, 1]
    res = stitch_calls(s.calls)
    assert [x.tokens for x in res.samples] == [[1, 2, 3, 4, 7], [1, 5, 6, 4, 8]]
    assert res.segment_calls == [[0, 2], [1, 3]]


def test_retry_extends_the_earlier_call_as_a_branch_not_compaction():
    """A retried turn (same history as the call it repeats) APPENDs to that call's parent on a new chain."""
    r1 = {"role": "assistant", "content": "x"}
    follow = [USER, r1, {"role": "user", "content": "y"}]
    c1 = call([1, 2], [3], [USER], r1)
    c2 = call([1, 2, 3, 4], [5], follow, {"role": "assistant", "content": "first try"})
    c3 = call([1, 2, 3, 4], [6], follow, {"role": "assistant", "content": "retry"})
    s = run_session([c1, c2, c3])
    assert [c.label.kind for c in s.calls] == [NEW, APPEND, APPEND]
    assert s.calls[2].label.reason == "prompt extends call 0 (a branch: call 1 already extends it)"
    assert [c.label.chain for c in s.calls] == [0, 0, 1]
    res = stitch_calls(s.calls)
    assert [x.tokens for x in res.samples] == [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6]]
    assert [x.loss_mask for x in res.samples] == [[0, 0, 1, 0, 1], [0, 0, 0, 0, 1]]  # call 0's output trained once
