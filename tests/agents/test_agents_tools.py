"""Tools, tool-call parsers, agents and environments (no server)."""

import asyncio
import json
import time

import pytest
from transformers import AutoTokenizer

from training.agents import (
    Action,
    FunctionTool,
    IntermediateRewards,
    StepResult,
    TaskEnvironment,
    Tool,
    ToolAgent,
    ToolCall,
    ToolEnvironment,
    ToolManager,
    get_tool_parser,
    render_prompt_ids,
)
from training.openai_api.tool_parsers import messages_with_tools


# ---------------------------------------------------------------- parsers


def test_hermes_parser_reads_good_calls_and_keeps_content():
    text = (
        'Let me compute. <tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n</tool_call>'
        '<tool_call>{"name": "lookup_price", "arguments": "{\\"item\\": \\"pen\\"}"}</tool_call> done'
    )
    parsed = get_tool_parser("hermes").parse(text, id_prefix="c")
    assert [(c.id, c.name, c.arguments) for c in parsed.calls] == [
        ("c0", "calculator", {"expression": "2+3"}),
        ("c1", "lookup_price", {"item": "pen"}),
    ]
    assert parsed.errors == [] and parsed.content == "Let me compute.  done"


def test_hermes_parser_accepts_unclosed_trailing_block_and_parameters_alias():
    parsed = get_tool_parser("qwen").parse('<tool_call>{"name": "finish", "parameters": {"answer": "5"}}')
    assert [(c.name, c.arguments) for c in parsed.calls] == [("finish", {"answer": "5"})]


@pytest.mark.parametrize(
    "body, fragment",
    [
        ('{"name": "calculator", "arguments": {"expression": "2+3"}', "not valid JSON"),
        ('{"arguments": {}}', "string 'name'"),
        ('["calculator"]', "must be a JSON object"),
        ('{"name": "calculator", "arguments": [1, 2]}', "'arguments' of 'calculator' must be a JSON object"),
        ('{"name": "calculator", "arguments": "{oops"}', "string that is not JSON"),
    ],
)
def test_hermes_parser_turns_malformed_calls_into_errors(body, fragment):
    parsed = get_tool_parser("hermes").parse(
        f'x <tool_call>{body}</tool_call> y <tool_call>{{"name": "ok", "arguments": {{}}}}</tool_call>'
    )
    assert len(parsed.errors) == 1 and fragment in parsed.errors[0]
    assert [c.name for c in parsed.calls] == ["ok"]


def test_json_parser_object_list_fence_plain_and_malformed():
    p = get_tool_parser("json")
    assert [c.name for c in p.parse('{"name": "a", "arguments": {"x": 1}}').calls] == ["a"]
    listed = p.parse('```json\n[{"name": "a", "arguments": {}}, {"name": "b"}, {"nam": "c"}]\n```')
    assert [c.name for c in listed.calls] == ["a", "b"] and len(listed.errors) == 1
    plain = p.parse("The answer is 5.")
    assert plain.calls == [] and plain.errors == [] and plain.content == "The answer is 5."
    assert "not valid JSON" in p.parse('{"name": "a", ').errors[0]
    with pytest.raises(ValueError, match="tool_parser"):
        get_tool_parser("xml")


def test_tool_schemas_render_through_the_chat_template(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    schema = FunctionTool(
        lambda x: x,
        name="echo",
        description="Echo x.",
        parameters={"type": "object", "properties": {"x": {"type": "string"}}},
    ).schema()
    ids = render_prompt_ids(tok, [{"role": "user", "content": "hi"}], [schema])
    text = tok.decode(ids)
    assert json.dumps(schema) in text and text.endswith("<|im_start|>assistant\n")


def test_templates_that_ignore_tools_get_them_in_the_system_message(tiny_model_path):
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    schema = {"type": "function", "function": {"name": "echo", "description": "", "parameters": {}}}
    msgs, tools = messages_with_tools(tok, [{"role": "user", "content": "hi"}], [schema])
    assert tools is None and msgs[0]["role"] == "system" and '"name": "echo"' in msgs[0]["content"]
    assert '"name": "echo"' in tok.decode(render_prompt_ids(tok, [{"role": "user", "content": "hi"}], [schema]))


# ---------------------------------------------------------------- tool manager


class Boom(Tool):
    name = "boom"
    parameters = {"type": "object", "properties": {}}

    def apply(self):
        raise RuntimeError("kaput")


class Hang(Tool):
    name = "hang"
    parameters = {"type": "object", "properties": {}}

    async def apply_async(self):
        await asyncio.sleep(30)


class SlowSync(Tool):
    name = "slow"
    parameters = {"type": "object", "properties": {"s": {"type": "number"}}, "required": ["s"]}

    def apply(self, s):
        time.sleep(s)
        return {"slept": s}


def test_calls_run_in_parallel_with_deadline_and_failures_become_observations():
    manager = ToolManager([Boom(), Hang(), SlowSync()], timeout_s=1.0)
    calls = [
        ToolCall("a", "hang"),
        ToolCall("b", "boom"),
        ToolCall("c", "slow", {"s": 0.8}),
        ToolCall("d", "slow", {"s": 0.8}),
        ToolCall("e", "missing"),
        ToolCall("f", "slow", {"s": "long"}),
        ToolCall("g", "slow", {}),
        ToolCall("h", "slow", {"s": 0.1, "extra": 1}),
    ]
    t0 = time.perf_counter()
    results = asyncio.run(manager.execute_all(calls))
    wall = time.perf_counter() - t0
    # the hang is cut at its 1 s deadline; the two 0.8 s sleeps overlap it: serial would be >= 2.6 s
    assert 0.95 <= wall < 2.2, wall
    assert [r.call_id for r in results] == list("abcdefgh")
    assert [r.status for r in results] == [
        "timeout",
        "error",
        "ok",
        "ok",
        "unknown_tool",
        "bad_arguments",
        "bad_arguments",
        "bad_arguments",
    ]
    assert "within 1 s" in results[0].output and "RuntimeError: kaput" in results[1].output
    assert results[2].output == '{"slept": 0.8}'
    assert "Available tools: boom, hang, slow" in results[4].output
    assert "'s' must be of type number" in results[5].output and "missing required argument(s): s" in results[6].output
    assert "unexpected argument(s): extra" in results[7].output


def test_per_tool_timeout_overrides_the_manager_and_outputs_are_truncated():
    hang = Hang()
    hang.timeout_s = 0.05
    manager = ToolManager([hang, FunctionTool(lambda: "x" * 50, name="big")], timeout_s=5.0, max_output_chars=10)
    t0 = time.perf_counter()
    slow, big = asyncio.run(manager.execute_all([ToolCall("a", "hang"), ToolCall("b", "big")]))
    assert slow.status == "timeout" and time.perf_counter() - t0 < 1.0
    assert big.ok and big.output.startswith("x" * 10 + "... [truncated 40 chars]")
    with pytest.raises(ValueError, match="already registered"):
        manager.register(FunctionTool(lambda: 1, name="big"))


# ---------------------------------------------------------------- agents and environments


def score(answer, task):
    return 1.0 if answer.strip() == task["answer"] else 0.0


def adder():
    return ToolManager(
        [
            FunctionTool(
                lambda a, b: a + b,
                name="add",
                parameters={
                    "type": "object",
                    "required": ["a", "b"],
                    "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                },
            )
        ]
    )


def test_tool_environment_stops_at_max_steps_and_scores_no_answer():
    env = ToolEnvironment({"answer": "3"}, adder(), score, max_steps=3)
    agent = ToolAgent([{"role": "user", "content": "q"}], parser="hermes")
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'

    async def go():
        results = []
        while not results or not results[-1].done:
            results.append(await env.step(agent.act(reply)))
            agent.observe(results[-1])
        return results

    results = asyncio.run(go())
    assert len(results) == 3 and env.num_steps == 3
    assert results[-1].info == {"answer": "", "stop_reason": "max_steps", "final_reward": 0.0}
    assert [m["role"] for m in agent.messages] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert agent.messages[2] == {"role": "tool", "tool_call_id": "call_0_0", "content": "3"}


def test_tool_environment_finish_and_intermediate_rewards():
    env = ToolEnvironment({"answer": "3"}, adder(), score, intermediate_rewards=IntermediateRewards(-0.1, -0.2))
    agent = ToolAgent([{"role": "user", "content": "q"}])

    async def go():
        r1 = await env.step(
            agent.act(
                '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
                '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
                "<tool_call>not json</tool_call>"
            )
        )
        new = agent.observe(r1)
        r2 = await env.step(agent.act('<tool_call>{"name": "finish", "arguments": {"answer": "3"}}</tool_call>'))
        return r1, new, r2

    r1, new, r2 = asyncio.run(go())
    assert r1.reward == pytest.approx(-0.1 - 0.2) and not r1.done
    assert r1.observation["tool_statuses"] == {"call_0_0": "bad_arguments", "call_0_1": "ok"}
    assert [m["role"] for m in new] == ["tool", "tool", "tool"] and "could not parse" in new[2]["content"]
    assert r2.done and r2.reward == 1.0 and r2.info["stop_reason"] == "finish"
    off = ToolEnvironment({"answer": "3"}, adder(), score)  # shaping is off by default
    r = asyncio.run(off.step(Action(text="", tool_calls=[ToolCall("x", "missing")])))
    assert r.reward == 0.0 and r.observation["tool_statuses"] == {"x": "unknown_tool"}


def test_reply_without_call_is_the_answer_or_gets_a_reminder():
    done = asyncio.run(ToolEnvironment({"answer": "7"}, adder(), score).step(Action(text="7")))
    assert done.done and done.reward == 1.0 and done.info["stop_reason"] == "answer"
    env = ToolEnvironment({"answer": "7"}, adder(), score, answer_without_finish=False)
    agent = ToolAgent([{"role": "user", "content": "q"}])
    r = asyncio.run(env.step(agent.act("7")))
    assert not r.done and agent.observe(r) == [{"role": "user", "content": env.reminder}]


def test_task_environment_scores_one_turn_and_validates():
    r = asyncio.run(TaskEnvironment({"answer": "5"}, score).step(Action(text=" 5 ")))
    assert r.done and r.reward == 1.0
    with pytest.raises(ValueError, match="max_steps"):
        ToolEnvironment({}, adder(), score, max_steps=0)
    with pytest.raises(ValueError, match="finish"):
        ToolEnvironment({}, ToolManager([FunctionTool(lambda: 1, name="finish")]), score)
    with pytest.raises(ValueError, match="messages"):
        ToolAgent([])
    assert isinstance(StepResult().observation, dict)


def test_template_check_flags_templates_that_strip_thinking(tiny_model_path):
    from training.agents.template_check import check_template_appends

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert all(c.appends for c in check_template_appends(tok))
    # Qwen3-style: earlier assistant turns lose their <think> block when re-rendered
    tok.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and not loop.last %}"
        "{{ m.content.split('</think>')[-1].lstrip() }}"
        "{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    checks = check_template_appends(tok)
    assert [(c.turn, c.appends) for c in checks] == [(2, False), (5, False), (7, True), (9, True)]
    assert checks[0].reason == "thinking stripped from an earlier turn"


def test_template_check_takes_sdk_histories_and_template_kwargs(tiny_model_path, caplog):
    from training.agents.template_check import main
    from training.openai_api.template_check import (
        SCRIPT,
        TemplateCheckError,
        check_template_appends,
        run_template_check,
    )

    assert SCRIPT[7]["content"] is None and SCRIPT[7]["tool_calls"]  # an SDK agent's tool-call-only turn
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    # a template that strips earlier thinking only when enable_thinking is false (reads only content)
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
        "{% if m['role'] == 'assistant' and not loop.last and enable_thinking is false %}"
        "{{ m['content'].split('</think>')[-1].lstrip() }}{% else %}{{ m['content'] }}{% endif %}"
        "{{ '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    assert all(c.appends for c in check_template_appends(tok))
    assert not check_template_appends(tok, enable_thinking=False)[0].appends
    assert run_template_check(tok, "warn", enable_thinking=True) and "does not only append" not in caplog.text
    run_template_check(tok, "warn", where="probe", enable_thinking=False)
    assert "probe: re-rendering the conversation does not only append (assistant message 2" in caplog.text
    with pytest.raises(TemplateCheckError, match="thinking stripped"):
        run_template_check(tok, "error", enable_thinking=False)
    tok.chat_template = "{{ raise_exception('no tools here') }}"
    with pytest.raises(TemplateCheckError, match="cannot render a tool conversation"):
        run_template_check(tok, "error")
    assert run_template_check(tok, "off") == [] and main(["tiny"]) == 0


@pytest.mark.slow
def test_template_check_cli_fails_smollm2_for_dropping_tools(capsys):
    from training.agents.template_check import main

    assert main(["smollm2", "--chat-template-kwargs", "{}"]) == 1  # every turn appends; its template ignores tools
    out = capsys.readouterr().out
    assert out.count("appends") == 4 and "the chat template ignores 'tools'" in out


def test_function_tool_schema_comes_from_signature_and_docstring():
    from typing import Literal, Optional

    def convert(amount: float, currency: Literal["EUR", "USD"] = "EUR", note: Optional[str] = None) -> str:
        """Convert an amount of coins to a currency.

        Args:
            amount: How many coins.
            currency: Target currency.
            note: A free-form note.
        """
        return f"{amount} {currency}"

    tool = FunctionTool(convert)
    assert tool.description == "Convert an amount of coins to a currency."
    assert tool.parameters == {
        "type": "object",
        "required": ["amount"],
        "properties": {
            "amount": {"type": "number", "description": "How many coins."},
            "currency": {"type": "string", "enum": ["EUR", "USD"], "description": "Target currency."},
            "note": {"type": "string", "nullable": True, "description": "A free-form note."},
        },
    }
    assert tool.check_arguments({"amount": 3, "note": None}) is None
    assert "must be of type number" in tool.check_arguments({"amount": "3"})
    assert "missing required argument(s): amount" in tool.check_arguments({})

    def partly(city: str, days=2, **extra):
        """Weather.

        Args:
            city: City name.
        """

    lenient = FunctionTool(partly)  # get_json_schema refuses it (untyped, undocumented): read what is there
    assert lenient.description == "Weather." and lenient.parameters == {
        "type": "object",
        "required": ["city"],
        "additionalProperties": True,
        "properties": {"city": {"type": "string", "description": "City name."}, "days": {}},
    }
    assert lenient.check_arguments({"city": "Oslo", "units": "C"}) is None
    assert FunctionTool(lambda x: x, name="f", parameters={"type": "object"}).parameters == {"type": "object"}
