"""Trajectory engine against the real embedded server on the tiny model.

The random-init model does not write tool calls by itself, so the agent's *decisions* are
scripted (``ScriptedToolAgent`` ignores the reply text when choosing calls); every token is
still the server's own output. A recording wrapper keeps each request's prompt and the
server's completion unchanged, so the checks compare against the server's ids.
"""

import asyncio

import pytest
from transformers import AutoTokenizer

from training.agents import (
    Action,
    ModelAgent,
    TaskEnvironment,
    ToolAgent,
    ToolCall,
    ToolEnvironment,
    ToolManager,
    TrajectoryEngine,
    make_agent_rollout_fn,
)
from training.agents.tools import FunctionTool
from training.deployment.client import DeploymentSampler
from training.utils.rl.rollout import RolloutRun, RolloutSample, RolloutSetup, flatten_result, validate_sample


class RecordingSampler:
    """Passes every call to the real sampler and keeps (prompt sent, completion returned)."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.sampling_defaults = sampler.sampling_defaults
        self.calls = []

    async def sample_with_prompt_tokens(self, prompt_ids, n=1, **kw):
        sent = list(prompt_ids)
        out = await self.sampler.sample_with_prompt_tokens(prompt_ids, n, **kw)
        self.calls.append((sent, out[0], kw))
        return out


class ScriptedToolAgent(ToolAgent):
    """A tool agent whose calls per turn come from ``script`` (the reply text is recorded, not parsed)."""

    def __init__(self, messages, script, compact_after=None):
        super().__init__(messages)
        self.script = script
        self.compact_after = compact_after

    def parse(self, text, turn):
        calls = [ToolCall(f"call_{turn}_{i}", name, args) for i, (name, args) in enumerate(self.script[turn])]
        return Action(text=text, tool_calls=calls)

    def compact(self):
        if self.compact_after is not None and len(self.steps) == self.compact_after:
            # keep the task, summarise the rest: the token prefix breaks
            return self.messages[:1] + [{"role": "user", "content": "Summary: the sum is 5. Call finish."}]
        return None


def tools():
    def add(a: int, b: int) -> int:
        return a + b

    return ToolManager(
        [
            FunctionTool(
                add,
                parameters={
                    "type": "object",
                    "required": ["a", "b"],
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                },
            )
        ],
        timeout_s=2.0,
    )


def reward_fn(answer, task):
    return 1.0 if answer.strip() == task["answer"] else 0.0


TASK = {"messages": [{"role": "user", "content": "What is 2 + 3?"}], "answer": "5"}
SCRIPT = [
    [("add", {"a": 2, "b": 3})],
    [("add", {"a": 1, "b": 1}), ("nope", {}), ("add", {"a": "x"})],
    [("finish", {"answer": "5"})],
]


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


def test_three_turn_episode_masks_exactly_the_server_tokens(server, tokenizer):
    async def go(sampler):
        rec = RecordingSampler(sampler)
        episode = await TrajectoryEngine(rec, tokenizer).collect(
            ScriptedToolAgent(TASK["messages"], SCRIPT), ToolEnvironment(TASK, tools(), reward_fn)
        )
        return rec, episode

    rec, episode = run(server, go)
    assert len(rec.calls) == 3 and episode.metadata["num_turns"] == 3
    (sample,) = episode.segments
    validate_sample(sample)
    assert episode.reward == 1.0 and sample.reward == 1.0 and episode.metadata["turns"][-1]["done"]
    # every prompt sent is a prefix of the final tokens, and the server echoed that same prompt
    for sent, c, _ in rec.calls:
        assert sample.tokens[: len(sent)] == sent == c.prompt_tokens
    # mask-1 tokens are exactly the server's generated ids in order, with its logprobs
    assert [t for t, m in zip(sample.tokens, sample.loss_mask) if m] == [
        t for _, c, _ in rec.calls for t in c.output_tokens
    ]
    assert [lp for lp, m in zip(sample.logprobs, sample.loss_mask) if m] == [
        lp for _, c, _ in rec.calls for lp in c.inference_logprobs
    ]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    assert sample.token_weight_versions == [v for _, c, _ in rec.calls for v in c.token_weight_versions]
    # prompt k+1 = prompt k + output k + glue (mask 0), and the glue carries the tool results
    for (p0, c0, _), (p1, _, _) in zip(rec.calls, rec.calls[1:]):
        assert p1[: len(p0) + len(c0.output_tokens)] == p0 + c0.output_tokens
        start = len(p0) + len(c0.output_tokens)
        assert sample.loss_mask[start : len(p1)] == [0] * (len(p1) - start)
    glue_1 = tokenizer.decode(rec.calls[1][0][len(rec.calls[0][0]) + len(rec.calls[0][1].output_tokens) :])
    assert "<tool_response>\n5\n</tool_response>" in glue_1 and glue_1.endswith("<|im_start|>assistant\n")
    glue_2 = tokenizer.decode(rec.calls[2][0][len(rec.calls[1][0]) + len(rec.calls[1][1].output_tokens) :])
    assert "<tool_response>\n2\n</tool_response>" in glue_2 and "unknown tool 'nope'" in glue_2
    assert "bad arguments for add" in glue_2
    assert episode.metadata["turns"][1]["statuses"] == {
        "call_1_0": "ok",
        "call_1_1": "unknown_tool",
        "call_1_2": "bad_arguments",
    }
    assert episode.metadata["tool_status_counts"] == {"ok": 2, "unknown_tool": 1, "bad_arguments": 1}
    assert [m["role"] for m in episode.metadata["messages"]] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "tool",
        "tool",
        "tool",
        "assistant",
    ]


def test_compaction_breaks_the_prefix_into_two_segments(server, tokenizer):
    async def go(sampler):
        rec = RecordingSampler(sampler)
        agent = ScriptedToolAgent(TASK["messages"], SCRIPT, compact_after=1)
        episode = await TrajectoryEngine(rec, tokenizer).collect(agent, ToolEnvironment(TASK, tools(), reward_fn))
        return rec, episode

    rec, episode = run(server, go)
    result = episode.to_result()
    assert isinstance(result, RolloutRun) and len(result.segments) == 2
    assert [s["reason"] for s in episode.metadata["segments"]] == ["start", "compaction"]
    samples = flatten_result(result)
    assert all(s.reward == episode.reward for s in samples)
    first, second = samples
    # segment 1 ends with turn 0's output; segment 2 starts from the re-rendered, compacted context
    assert first.tokens == rec.calls[0][0] + rec.calls[0][1].output_tokens
    assert "Summary: the sum is 5" in tokenizer.decode(rec.calls[1][0])
    for sent, _, _ in rec.calls[1:]:
        assert second.tokens[: len(sent)] == sent
    assert [t for t, m in zip(second.tokens, second.loss_mask) if m] == [
        t for _, c, _ in rec.calls[1:] for t in c.output_tokens
    ]


def test_over_length_stops_with_finish_reason_length(server, tokenizer):
    always_add = [[("add", {"a": 1, "b": 2})]] * 50

    async def go(sampler):
        rec = RecordingSampler(sampler)
        engine = TrajectoryEngine(rec, tokenizer)
        env = ToolEnvironment(TASK, tools(), reward_fn, max_steps=50)
        first_len = len(engine.render_prompt(TASK["messages"], env.tool_schemas()))
        engine.max_total_tokens = first_len + 40
        episode = await engine.collect(ScriptedToolAgent(TASK["messages"], always_add), env)
        return rec, episode, first_len

    rec, episode, first_len = run(server, go)
    (sample,) = episode.segments
    assert episode.finish_reason == "length" == sample.finish_reason
    assert len(sample.tokens) <= first_len + 40
    assert all(kw["max_tokens"] <= first_len + 40 - len(sent) for sent, _, kw in rec.calls)
    validate_sample(sample)
    assert episode.reward == 0.0 and episode.metadata["final_reward"] == 0.0


def test_make_agent_rollout_fn_runs_a_task_environment(server, tokenizer):
    make_rollout_fn = make_agent_rollout_fn(
        agent_factory=lambda row: ModelAgent(row["messages"]),
        env_factory=lambda row: TaskEnvironment(row, reward_fn),
        as_run=False,
    )

    async def go(sampler):
        setup = RolloutSetup(sampler=sampler, tokenizer=tokenizer, sampling_kwargs={"max_tokens": 5}, max_seq_len=2048)
        fn = make_rollout_fn(setup)
        return [await fn(TASK) for _ in range(2)]

    results = run(server, go)
    for r in results:
        assert isinstance(r, RolloutSample) and 1 <= r.num_trainable_tokens <= 5
        validate_sample(r)


def test_orchestrator_groups_real_episodes(server, tokenizer):
    from training.agents import Orchestrator

    rows = [dict(TASK, id=i) for i in range(3)]

    async def go(sampler):
        orch = Orchestrator(
            TrajectoryEngine(sampler, tokenizer),
            lambda row: ModelAgent(row["messages"]),
            lambda row: TaskEnvironment(row, reward_fn),
            group_size=2,
            max_concurrency=4,
        )
        return [g async for g in orch.run(rows)]

    groups = run(server, go)
    assert sorted(g.key for g in groups) == [0, 1, 2]
    for g in groups:
        assert len(g.episodes) == 2 and g.errors == []
        for r in g.results():
            assert all(validate_sample(s) is None for s in flatten_result(r))
