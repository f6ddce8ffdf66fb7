"""In-process agents: per-call transitions and episode stop reasons, on the real server (tiny model).

The random-init model does not write tool calls by itself, so the agent's *decisions* are
scripted (``ScriptedToolAgent`` ignores the reply text when choosing calls); every token is the
server's own output, kept by a recording wrapper so the checks compare against the server's ids.
"""

import asyncio

import pytest
from transformers import AutoTokenizer

from training.agents import (
    Action,
    IntermediateRewards,
    ToolAgent,
    ToolCall,
    ToolEnvironment,
    ToolManager,
    TrajectoryEngine,
    make_agent_rollout_fn,
)
from training.agents.tools import FunctionTool
from training.deployment.client import DeploymentSampler
from training.utils.rl.credit import discounted
from training.utils.rl.rollout import RolloutRun, RolloutSetup, flatten_result
from training.utils.rl.run_metrics import run_metrics

TASK = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
SCRIPT = [
    [("add", {"a": 2, "b": 3})],
    [("add", {"a": 1, "b": 1}), ("nope", {}), ("add", {"a": "x"})],  # ok, unknown tool, bad arguments
    [("finish", {"answer": "5"})],
]


class RecordingSampler:
    """The real sampler, keeping every (prompt sent, completion returned); ``with_defaults`` keeps recording."""

    def __init__(self, sampler, calls=None):
        self.sampler = sampler
        self.sampling_defaults = sampler.sampling_defaults
        self.calls = [] if calls is None else calls

    def with_defaults(self, **kw):
        return RecordingSampler(self.sampler.with_defaults(**kw), self.calls)

    async def sample_with_prompt_tokens(self, prompt_ids, n=1, **kw):
        sent = list(prompt_ids)
        out = await self.sampler.sample_with_prompt_tokens(prompt_ids, n, **kw)
        self.calls.append((sent, out[0]))
        return out


class ScriptedToolAgent(ToolAgent):
    def __init__(self, messages, script):
        super().__init__(messages)
        self.script = script

    def parse(self, text, turn):
        calls = [ToolCall(f"call_{turn}_{i}", name, args) for i, (name, args) in enumerate(self.script[turn])]
        return Action(text=text, tool_calls=calls)


def tools():
    def add(a: int, b: int) -> int:
        return a + b

    schema = {
        "type": "object",
        "required": ["a", "b"],
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    }
    return ToolManager([FunctionTool(add, parameters=schema)], timeout_s=2.0)


def reward_fn(answer, task):
    return 1.0 if answer.strip() == task["answer"] else 0.0


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def run(server, coro_fn):
    async def go():
        sampler = DeploymentSampler(server.base_url, sampling_defaults={"max_tokens": 6, "temperature": 1.0})
        try:
            return await coro_fn(sampler)
        finally:
            await sampler.close()

    return asyncio.run(go())


def test_transitions_give_one_exact_sample_per_call_with_documented_rewards(server, tokenizer):
    """r_k = g_k·R + i_k: R = 1 (answer 5), g = discounted(0.5) = [0.25, 0.5, 1], i = AIR of call k
    (call 1 made an unknown-tool and a bad-arguments call: 2 x -0.5); weight 1/3 each."""
    air = IntermediateRewards(failed_call=-0.5, unparsable_call=-0.25)
    make_rollout_fn = make_agent_rollout_fn(
        agent_factory=lambda row: ScriptedToolAgent(row["messages"], SCRIPT),
        env_factory=lambda row: ToolEnvironment(row, tools(), reward_fn, intermediate_rewards=air),
        mode="transitions",
        credit_fn=discounted(0.5),
    )

    async def go(sampler):
        rec = RecordingSampler(sampler)
        setup = RolloutSetup(sampler=rec, tokenizer=tokenizer, sampling_kwargs={"max_tokens": 6}, max_seq_len=4096)
        return rec, await make_rollout_fn(setup)(TASK)

    rec, result = run(server, go)
    assert isinstance(result, RolloutRun) and result.segment_rewards and result.reward == 1.0
    samples = flatten_result(result)  # validated against the contract
    assert len(samples) == len(rec.calls) == 3
    for sample, (sent, c) in zip(samples, rec.calls):
        assert sample.tokens == sent + c.output_tokens and sent == c.prompt_tokens
        assert sample.loss_mask == [0] * len(sent) + [1] * len(c.output_tokens)
        assert sample.logprobs == [0.0] * len(sent) + list(c.inference_logprobs)
        assert sample.token_weight_versions == c.token_weight_versions
    assert [s.reward for s in samples] == pytest.approx([0.25 * 1.0, 0.5 * 1.0 - 1.0, 1.0 * 1.0])
    assert [s.weight for s in samples] == pytest.approx([1 / 3] * 3)
    meta = result.metadata
    assert meta["mode"] == "transitions" and meta["stop_reason"] == "finish"
    assert result.return_weights == meta["return_weights"] == pytest.approx([0.25, 0.5, 1.0])
    assert meta["intermediate_rewards"] == pytest.approx([0.0, -1.0, 0.0])
    assert meta["run_reward"] == 1.0 and meta["return"] == pytest.approx(0.0)  # stitch's return: R + sum(i)


def test_stitch_mode_is_unchanged_and_records_the_stop_reason(server, tokenizer):
    make_rollout_fn = make_agent_rollout_fn(
        agent_factory=lambda row: ScriptedToolAgent(row["messages"], SCRIPT),
        env_factory=lambda row: ToolEnvironment(
            row, tools(), reward_fn, intermediate_rewards=IntermediateRewards(failed_call=-0.5)
        ),
    )

    async def go(sampler):
        setup = RolloutSetup(sampler=sampler, tokenizer=tokenizer, sampling_kwargs={"max_tokens": 6}, max_seq_len=4096)
        return await make_rollout_fn(setup)(TASK)

    result = run(server, go)
    (sample,) = flatten_result(result)
    assert result.reward == sample.reward == pytest.approx(1.0 - 1.0)  # R + sum of the calls' AIR
    assert result.metadata["mode"] == "stitch" and result.metadata["stop_reason"] == "finish"
    assert result.metadata["intermediate_rewards"] == pytest.approx([0.0, -1.0, 0.0])


def test_episode_stop_reasons_and_their_metrics(server, tokenizer):
    """``max_steps`` (the sampler said ``stop`` or ``length``, the episode hit its step limit), ``length``
    (over-length) and ``finish``; with one timed-out completion, the fractions count it too."""
    always_add = [[("add", {"a": 1, "b": 2})]] * 50

    async def go(sampler):
        engine = TrajectoryEngine(sampler, tokenizer)
        capped = await engine.collect(
            ScriptedToolAgent(TASK["messages"], always_add), ToolEnvironment(TASK, tools(), reward_fn, max_steps=2)
        )
        finished = await engine.collect(
            ScriptedToolAgent(TASK["messages"], SCRIPT), ToolEnvironment(TASK, tools(), reward_fn)
        )
        env = ToolEnvironment(TASK, tools(), reward_fn, max_steps=50)
        engine.max_total_tokens = len(engine.render_prompt(TASK["messages"], env.tool_schemas())) + 40
        cut = await engine.collect(ScriptedToolAgent(TASK["messages"], always_add), env)
        return capped, finished, cut

    capped, finished, cut = run(server, go)
    assert capped.stop_reason == capped.metadata["stop_reason"] == "max_steps" and capped.finish_reason != "max_steps"
    assert capped.metadata["num_turns"] == 2 and capped.to_result(as_run=True).metadata["stop_reason"] == "max_steps"
    assert finished.stop_reason == "finish"
    assert cut.stop_reason == "length" == cut.finish_reason
    metas = [e.to_result(as_run=True).metadata for e in (capped, finished, cut)]
    m = run_metrics(metas, failure_causes={"timeout": 1})
    assert m["rollout/stop_reason/max_steps"] == m["rollout/stop_reason/finish"] == pytest.approx(0.25)
    assert m["rollout/stop_reason/length"] == m["rollout/stop_reason/timeout"] == pytest.approx(0.25)
    assert m["rollout/stop_reason/error"] == 0.0


def test_transitions_mode_is_checked():
    with pytest.raises(ValueError, match="mode: 'per_call' is not one of"):
        make_agent_rollout_fn(lambda row: None, lambda row: None, mode="per_call")
