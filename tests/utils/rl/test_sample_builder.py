"""The one sample builder: its conventions, and the proxy and the in-process agents giving byte-identical
samples and facts for the same calls.

No server: the agents' path runs ``make_agent_rollout_fn`` (and the text-gym adapter) on a scripted
sampler that answers with fixed output ids, logprobs and weight versions, through a character-level
chat template; the calls it made (the exact prompts it rendered, the scripted outputs) are then
replayed as hand-built ``CallRecord``s through the proxy's turn matching and ``episode_result``, as
``tests/proxy/test_proxy_matching.py`` builds them.
"""

import asyncio
import json
from dataclasses import asdict

import pytest

from training.agents import ConversationAgent, Environment, StepResult, make_agent_rollout_fn
from training.deployment.client import Completion
from training.envs.text_gym import make_text_gym_rollout_fn
from training.proxy import make_proxy_rollout_fn
from training.proxy.records import CallRecord, SessionRecord
from training.utils.rl.rollout import RolloutSetup, flatten_result
from training.utils.rl.rollout.episode_facts import EpisodeFacts
from training.utils.rl.rollout.sample_builder import CONTEXT_VERSION, CallTokens, SampleBuilder, call_weight_versions
from training.utils.rl.rollout.turn_matching import assign
from training.utils.rl.run_metrics import AGENT_KEYS

pytestmark = pytest.mark.unit


def call(prompt, output, versions, *, finish="stop", trainable=True, index=0):
    return CallTokens(
        list(prompt), list(output), [-0.5 - i for i in range(len(output))], versions, finish, index, trainable
    )


# ---- the builder's conventions -----------------------------------------------------------------


def test_context_has_no_version_and_a_sample_lists_one_version_per_trainable_token():
    b = SampleBuilder.of_call(call([1, 2], [3, 4], [7, 8]))
    b.add_call(call([1, 2, 3, 4, 5], [6], [9], index=1))
    assert b.weight_versions == [CONTEXT_VERSION, CONTEXT_VERSION, 7, 8, CONTEXT_VERSION, 9]
    s = b.to_sample(1.0)
    assert s.tokens == [1, 2, 3, 4, 5, 6] and s.loss_mask == [0, 0, 1, 1, 0, 1]
    assert s.logprobs == [0.0, 0.0, -0.5, -1.5, 0.0, -0.5] and s.token_weight_versions == [7, 8, 9]
    assert b.calls == [0, 1]


def test_per_token_versions_win_else_the_calls_version_and_an_unknown_one_gives_none():
    assert call_weight_versions([4, 5], 4, 2) == [4, 5]
    assert call_weight_versions(None, 6, 3) == [6, 6, 6]
    unknown = SampleBuilder.of_call(call([1], [2, 3], call_weight_versions(None, -1, 2)))
    assert unknown.to_sample(0.0).token_weight_versions is None  # never a list the contract refuses


def test_an_untrained_output_is_context_with_logprob_zero():
    b = SampleBuilder.of_call(call([1], [2, 3], [1, 1], trainable=False))
    assert b.to_sample(1.0) is None  # nothing trainable
    b.add_call(call([1, 2, 3, 4], [5], [2], index=1))
    s = b.to_sample(1.0)
    assert s.loss_mask == [0, 0, 0, 0, 1] and s.logprobs == [0.0, 0.0, 0.0, 0.0, -0.5]
    assert s.token_weight_versions == [2]


def test_add_call_refuses_a_prompt_that_does_not_extend_the_sequence():
    b = SampleBuilder.of_call(call([1, 2], [3], [0]))
    assert not b.extends([1, 9, 3, 4])
    with pytest.raises(ValueError, match="does not extend"):
        b.add_call(call([1, 9, 3, 4], [5], [0]))
    with pytest.raises(ValueError, match="weight_versions"):
        b.add_output(call([], [5, 6], [0]))


def test_to_sample_cuts_to_max_seq_len_and_says_length():
    b = SampleBuilder.of_call(call([1, 2], [3, 4, 5], [1, 2, 3]))
    s = b.to_sample(1.0, max_seq_len=4)
    assert s.tokens == [1, 2, 3, 4] and s.finish_reason == "length" and s.token_weight_versions == [1, 2]
    assert SampleBuilder.of_call(call([1, 2], [3], [0])).to_sample(1.0, max_seq_len=2) is None


def test_episode_facts_write_the_documented_keys_and_only_those_set():
    facts = EpisodeFacts(mode="stitch", stop_reason="finish", episode_return=1.5, num_calls=2)
    assert facts.to_metadata() == {"mode": "stitch", "stop_reason": "finish", "return": 1.5, "num_calls": 2}
    assert EpisodeFacts().to_metadata() == {}
    assert set(AGENT_KEYS) <= set(EpisodeFacts.keys())  # every key the step metrics read has a typed field


# ---- the same calls through the agents and through the proxy -------------------------------------


class CharTokenizer:
    """A chat template over characters (one id per character): ``<role>content</s>`` per message."""

    def apply_chat_template(self, messages, tools=None, tokenize=True, add_generation_prompt=False, **kw):
        text = "".join(f"<{m['role']}>{m.get('content') or ''}</s>" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        return self.encode(text) if tokenize else text

    def encode(self, text, add_special_tokens=False):
        return [ord(ch) for ch in text]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


SCRIPT = [  # (output text, weight_version, per-token versions): an in-flight update lands in the first call
    ("ab", 4, [4, 5]),
    ("cde", 5, None),
    ("f", 5, [6]),
]


class ScriptedSampler:
    """Answers call k with ``script[k]`` whatever the prompt; keeps (prompt sent, completion)."""

    base_url = "http://127.0.0.1:9"
    sampling_defaults: dict = {}

    def __init__(self, script):
        self.script, self.calls = list(script), []

    def with_defaults(self, **kw):
        return self

    async def sample_with_prompt_tokens(self, prompt_ids, n=1, **kw):
        text, version, per_token = self.script[len(self.calls)]
        out = [ord(ch) for ch in text]
        c = Completion(
            full_tokens=list(prompt_ids) + out,
            prompt_len=len(prompt_ids),
            inference_logprobs=[-0.25 * (i + 1) - len(self.calls) for i in range(len(out))],
            finish_reason="stop",
            text=text,
            weight_version=version,
            token_weight_versions=per_token,
        )
        self.calls.append((list(prompt_ids), c))
        return [c]


class ThreeTurns(Environment):
    """Opens with the row's question (``reset``), says "again" twice, then ends with reward 1."""

    def __init__(self, row):
        self.task, self.steps = row, 0

    async def reset(self):
        return [{"role": "user", "content": self.task["question"]}]

    async def step(self, action):
        self.steps += 1
        if self.steps == 3:
            return StepResult(reward=1.0, done=True, info={"final_reward": 1.0})
        return StepResult(observation={"text": "again"}, reward=0.0)


class ScriptedAgent(ConversationAgent):
    def __init__(self, compact_after=None, constrain_turn=None):
        super().__init__([{"role": "system", "content": "be brief"}])
        self.compact_after, self.constrain_turn = compact_after, constrain_turn

    def constraint_fields(self, turn):
        return {"response_format": {"type": "json_object"}} if turn == self.constrain_turn else {}

    def compact(self):
        if self.compact_after is not None and len(self.steps) == self.compact_after:
            return self.messages[:1] + [{"role": "user", "content": "summary: go on"}]
        return None


SCENARIOS = {
    "one_segment": ({}, SCRIPT),
    "compaction": ({"compact_after": 1}, SCRIPT),
    "excluded_constrained_call": ({"constrain_turn": 0}, SCRIPT),
    "unknown_version": ({}, [("ab", -1, None)] + SCRIPT[1:]),
}


def run_agents(make_rollout_fn, script):
    sampler = ScriptedSampler(script)
    fn = make_rollout_fn(RolloutSetup(sampler=sampler, tokenizer=CharTokenizer()))
    run = asyncio.run(fn({"question": "2 + 3?"}))
    return run, sampler.calls


def run_proxy(calls, trainable, mode):
    """The agents' calls as the proxy records them, through turn matching and ``episode_result``."""
    session = SessionRecord("s")
    for (prompt, c), train in zip(calls, trainable):
        record = CallRecord(
            index=-1,
            endpoint="completions",
            agent="default",
            prompt_ids=prompt,
            output_ids=c.output_tokens,
            output_logprobs=c.inference_logprobs,
            finish_reason=c.finish_reason,
            weight_version=c.weight_version,
            upstream="u",
            token_weight_versions=c.token_weight_versions,
            trainable=train,
        )
        assign(session, record, "tokens")
    make = make_proxy_rollout_fn(
        lambda row, endpoint: None,
        reward_fn=lambda row, result: 1.0,
        mode=mode,
        strategy="tokens",
        template_check="off",
    )
    fn = make(RolloutSetup(sampler=ScriptedSampler([]), tokenizer=CharTokenizer()))

    async def go():
        try:
            return await fn.episode_result({}, None, session)
        finally:
            await fn.close()

    return asyncio.run(go())


SHARED_KEYS = ("mode", "stop_reason", "return", "num_calls", "labels", "drift", "tool_status_counts", "truncated")
CREDIT_KEYS = ("intermediate_rewards", "sample_calls", "credited_rewards", "sample_weights", "return_weights")


def sample_bytes(run):
    """Every sample as JSON bytes: tokens, logprobs, loss_mask, weight versions, reward, weight, finish reason
    (``text``, log-only, is left out: the agents decode their last reply into it, the proxy has none)."""
    return [
        json.dumps({k: v for k, v in asdict(s).items() if k != "text"}, sort_keys=True).encode()
        for s in flatten_result(run)
    ]


def assert_same(agent_run, proxy_run, mode):
    assert sample_bytes(agent_run) == sample_bytes(proxy_run)
    assert (agent_run.reward, agent_run.segment_rewards, agent_run.return_weights) == (
        proxy_run.reward,
        proxy_run.segment_rewards,
        proxy_run.return_weights,
    )
    keys = SHARED_KEYS + (CREDIT_KEYS + ("run_reward",) if mode == "transitions" else ("intermediate_rewards",))
    a, p = agent_run.metadata, proxy_run.metadata
    assert {k: a[k] for k in keys} == {k: p[k] for k in keys}


@pytest.mark.parametrize("mode", ["stitch", "transitions"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_the_proxy_and_the_agents_build_byte_identical_samples_for_the_same_calls(scenario, mode):
    agent_kw, script = SCENARIOS[scenario]
    make = make_agent_rollout_fn(lambda row: ScriptedAgent(**agent_kw), ThreeTurns, template_check="off", mode=mode)
    agent_run, calls = run_agents(make, script)
    trainable = [t["trainable"] for t in agent_run.metadata["turns"]]
    assert_same(agent_run, run_proxy(calls, trainable, mode), mode)
    samples = flatten_result(agent_run)
    generated = [t for s in samples for t, m in zip(s.tokens, s.loss_mask) if m]
    trained = [c.output_tokens for (_, c), t in zip(calls, trainable) if t]
    assert generated == [t for out in trained for t in out]  # the builder trained exactly the outputs
    if scenario == "compaction" and mode == "stitch":
        assert len(samples) == 2 and agent_run.metadata["labels"] == {"NEW": 1, "APPEND": 1, "WIPE": 1}
    if scenario == "excluded_constrained_call":
        assert trainable == [False, True, True]
    if scenario == "unknown_version":
        assert samples[0].token_weight_versions is None  # stitch: one unknown token; transitions: its call
    else:
        versions = [v for s in samples for v in s.token_weight_versions]
        assert versions == [
            v
            for (_, c), t in zip(calls, trainable)
            if t
            for v in call_weight_versions(c.token_weight_versions, c.weight_version, len(c.output_tokens))
        ]


class Echo:
    """A gym-style text game: three replies, the last one earns 1."""

    def __init__(self):
        self.n = 0

    def reset(self):
        return "say something"

    def step(self, action):
        self.n += 1
        return "again", float(self.n == 3), self.n == 3, {}


def test_the_text_gym_adapter_goes_through_the_shared_rollout_and_builder():
    make = make_text_gym_rollout_fn(lambda row: Echo(), system_prompt="play", template_check="off")
    agent_run, calls = run_agents(make, SCRIPT)
    assert agent_run.metadata["messages"][:2] == [
        {"role": "system", "content": "play"},
        {"role": "user", "content": "say something"},  # TextGymEnvironment.reset: the first observation
    ]
    assert_same(agent_run, run_proxy(calls, [True] * 3, "stitch"), "stitch")
    [sample] = flatten_result(agent_run)
    assert sample.reward == 1.0 and sample.token_weight_versions == [4, 5, 5, 5, 5, 6]
