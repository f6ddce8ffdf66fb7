"""In-process agents: constrained calls and the ``constrained_calls`` switch (the proxy's name and meaning).

An agent that forces a tool call (``tool_choice``) sends it with the tool schemas on ``/v1/completions``;
the server constrains the output to one valid call and returns the masked distribution's logprobs. With
``constrained_calls="exclude"`` (default) that output is context (mask 0, no transitions sample); with
``"train"`` it trains with exactly the logprobs the server returned. Real server, tiny model: the forced
call is what makes a random model call a tool at all.
"""

import asyncio
import json

import pytest
from aiohttp import ClientSession
from transformers import AutoTokenizer

from training.agents import ToolAgent, ToolEnvironment, ToolManager, TrajectoryEngine, make_agent_rollout_fn
from training.agents.tools import FunctionTool
from training.deployment.client import DeploymentSampler
from training.deployment.engine.constraints import missing_library
from training.utils.rl.rollout import RolloutSetup, flatten_result

pytestmark = pytest.mark.skipif(missing_library() is not None, reason="needs llguidance (training[constrained])")

PICK = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "blue"]}},
    "required": ["color"],
    "additionalProperties": False,
}
TASK = {"messages": [{"role": "user", "content": "Pick a color."}], "answer": "red"}


def pick(color: str) -> str:
    return f"picked {color}"


class FirstTurnForced(ToolAgent):
    """Forces a call of ``pick`` on the first turn only; later turns are free."""

    def constraint_fields(self, turn):
        return super().constraint_fields(turn) if turn == 0 else {}


class RecordingSampler:
    """The real sampler, keeping every (prompt sent, sampling sent, completion returned)."""

    def __init__(self, sampler, calls=None):
        self.sampler, self.sampling_defaults = sampler, sampler.sampling_defaults
        self.calls = [] if calls is None else calls

    def with_defaults(self, **kw):
        return RecordingSampler(self.sampler.with_defaults(**kw), self.calls)

    async def sample_with_prompt_tokens(self, prompt_ids, n=1, **kw):
        out = await self.sampler.sample_with_prompt_tokens(prompt_ids, n, **kw)
        self.calls.append((list(prompt_ids), dict(kw), out[0]))
        return out


@pytest.fixture(scope="module")
def server(embedded_server):
    return embedded_server()


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def episode(server, tokenizer, constrained_calls, mode):
    tools = ToolManager([FunctionTool(pick, parameters=PICK)], timeout_s=2.0)
    make_rollout_fn = make_agent_rollout_fn(
        agent_factory=lambda row: FirstTurnForced(
            row["messages"], tool_choice={"type": "function", "function": {"name": "pick"}}
        ),
        env_factory=lambda row: ToolEnvironment(row, tools, lambda answer, task: 0.0, max_steps=2),
        mode=mode,
        constrained_calls=constrained_calls,
        template_check="off",
    )

    async def go():
        sampler = DeploymentSampler(
            server.base_url, sampling_defaults={"max_tokens": 40, "temperature": 1.0, "seed": 3}
        )
        try:
            rec = RecordingSampler(sampler)
            setup = RolloutSetup(sampler=rec, tokenizer=tokenizer, sampling_kwargs={}, max_seq_len=4096)
            return rec.calls, await make_rollout_fn(setup)(TASK)
        finally:
            await sampler.close()

    return asyncio.run(go())


@pytest.mark.parametrize("constrained_calls", ["exclude", "train"])
def test_a_forced_call_is_context_when_excluded_and_trained_with_its_masked_logprobs_otherwise(
    server, tokenizer, constrained_calls
):
    calls, run = episode(server, tokenizer, constrained_calls, "stitch")
    assert len(calls) == 2  # max_steps=2: the forced call, then a free one
    (_, sent0, forced), (_, sent1, free) = calls
    assert sent0["tool_choice"] == {"type": "function", "function": {"name": "pick"}} and sent0["tools"]
    assert "tool_choice" not in sent1 and "tools" not in sent1
    call = json.loads(forced.text.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0])
    assert call["name"] == "pick" and call["arguments"]["color"] in ("red", "blue")  # the grammar held
    turns = run.metadata["turns"]
    assert turns[0]["constraint"] == {"tool_choice": sent0["tool_choice"]} and turns[0]["statuses"]
    assert turns[1]["constraint"] is None and turns[1]["trainable"]
    [sample] = flatten_result(run)
    p0 = len(forced.prompt_tokens)
    span0 = slice(p0, p0 + len(forced.output_tokens))
    assert sample.tokens[span0] == forced.output_tokens
    span1 = slice(len(free.prompt_tokens), len(free.full_tokens))
    assert sample.tokens[span1] == free.output_tokens and sample.loss_mask[span1] == [1] * len(free.output_tokens)
    if constrained_calls == "exclude":
        assert turns[0]["trainable"] is False
        assert sample.loss_mask[span0] == [0] * len(forced.output_tokens)
        assert sample.logprobs[span0] == [0.0] * len(forced.output_tokens)
    else:
        assert turns[0]["trainable"] is True
        assert sample.loss_mask[span0] == [1] * len(forced.output_tokens)
        assert sample.logprobs[span0] == forced.inference_logprobs  # the masked distribution's, as served


@pytest.mark.parametrize("constrained_calls, samples", [("exclude", 1), ("train", 2)])
def test_transitions_give_no_sample_for_an_excluded_constrained_call(server, tokenizer, constrained_calls, samples):
    calls, run = episode(server, tokenizer, constrained_calls, "transitions")
    out = flatten_result(run)
    assert len(out) == samples and len(calls) == 2
    (_, _, free) = calls[1]
    assert out[-1].tokens == free.full_tokens  # the free call is always a sample of its own
    assert run.metadata["sample_calls"] == ([1] if constrained_calls == "exclude" else [0, 1])


def test_the_switch_is_checked_by_name():
    with pytest.raises(ValueError, match="constrained_calls"):
        make_agent_rollout_fn(lambda row: None, lambda row: None, constrained_calls="mask")
    with pytest.raises(ValueError, match="constrained_calls"):
        TrajectoryEngine(None, None, constrained_calls="yes")


def test_completions_take_tools_only_to_force_a_call(server):
    async def go():
        out = {}
        async with ClientSession() as s:
            base = {
                "prompt": [1, 2, 3],
                "max_tokens": 40,
                "seed": 1,
                "tools": [{"type": "function", "function": {"name": "pick", "parameters": PICK}}],
            }
            for name, extra in {"auto": {}, "required": {"tool_choice": "required"}}.items():
                async with s.post(server.base_url + "/v1/completions", json={**base, **extra}) as r:
                    out[name] = (r.status, await r.json())
        return out

    out = asyncio.run(go())
    status, body = out["auto"]
    assert status == 400 and body["error"]["param"] == "tools"  # not rendered, not forcing: refused, never ignored
    status, body = out["required"]
    assert status == 200
    text = body["choices"][0]["text"]
    assert text.startswith("<tool_call>\n") and json.loads(text.split("\n")[1])["name"] == "pick"
