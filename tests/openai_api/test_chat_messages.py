"""OpenAI-SDK histories reach the chat template in the form it renders (``training/openai_api/chat_messages.py``).

Unit tests of the normaliser, then the real server (tiny model; SmolLM2 slow-marked) taking
histories made by the unmodified ``openai`` SDK with ``model_dump(exclude_none=True)``.
"""

from __future__ import annotations

import json

import pytest

from training.openai_api.chat_messages import (
    ChatMessageError,
    assistant_text,
    normalise_messages,
    prepare_for_template,
    template_renders_tool_calls,
)
from training.openai_api.tool_parsers import render_prompt_ids, tool_rendering

CALL = {"id": "call_1", "type": "function", "function": {"name": "calculator", "arguments": '{"expression": "2 + 3"}'}}
CONTENT_ONLY_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""SmolLM2's kind of template: reads only role and content (fails on a missing content, drops tool calls)."""


def sdk_history():
    """A history as an OpenAI-SDK agent builds it after a tool-call-only reply."""
    openai = pytest.importorskip("openai")
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [CALL]})
    dumped = reply.model_dump(exclude_none=True)
    assert "content" not in dumped and openai  # what made SmolLM2's template fail
    return [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": "What is 2 + 3?"},
        dumped,
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]


def test_tool_call_only_reply_gets_empty_content_and_keeps_decoded_calls():
    msgs = normalise_messages(sdk_history())
    assert msgs[2] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "calculator", "arguments": {"expression": "2 + 3"}},
            }
        ],
    }
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "5", "name": "calculator"}


def test_sdk_noise_parts_developer_and_flat_calls_are_normalised():
    msgs = normalise_messages(
        [
            {
                "role": "developer",
                "content": [{"type": "text", "text": "Be "}, {"type": "input_text", "text": "brief."}],
            },
            {"role": "assistant", "content": None, "refusal": None, "annotations": [], "tool_calls": []},
            {"role": "assistant", "tool_calls": [{"id": "c", "name": "f", "arguments": {"a": 1}}]},
            {
                "role": "assistant",
                "content": "ok",
                "tool_calls": [{"id": "d", "function": {"name": "g", "arguments": ""}}],
            },
        ]
    )
    assert msgs[0] == {"role": "system", "content": "Be brief."}
    assert msgs[1] == {"role": "assistant", "content": ""}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"a": 1}}
    assert msgs[3]["tool_calls"][0]["function"]["arguments"] == {}


@pytest.mark.parametrize(
    "messages, path",
    [
        ([{"role": "robot", "content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], "messages[0].content[0]"),
        (
            [
                {"role": "user", "content": "a"},
                {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{not json"}}]},
            ],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
            "messages[0].tool_calls[0].function.name",
        ),
        ([{"role": "user", "content": "a", "tool_calls": [CALL]}], "messages[0].tool_calls"),
        ("hello", "messages"),
    ],
)
def test_bad_message_names_the_field(messages, path):
    with pytest.raises(ChatMessageError) as e:
        normalise_messages(messages)
    assert e.value.path == path


def test_content_only_template_gets_the_calls_in_hermes_format(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert template_renders_tool_calls(tok)  # the Qwen3-style template renders tool_calls itself
    native = prepare_for_template(sdk_history(), tok)
    assert native[2]["tool_calls"] and native[2]["content"] == ""
    tok.chat_template = CONTENT_ONLY_TEMPLATE
    assert not template_renders_tool_calls(tok)
    inlined = prepare_for_template(sdk_history(), tok)
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
    assert "tool_calls" not in inlined[2] and inlined[2]["content"] == text == assistant_text(native[2])
    rendered = tok.apply_chat_template(inlined, tokenize=False, add_generation_prompt=True)
    assert f"<|im_start|>assistant\n{text}<|im_end|>" in rendered
    from jinja2.exceptions import UndefinedError

    with pytest.raises(UndefinedError):  # what the server did before: the template reads a missing content
        tok.apply_chat_template(sdk_history(), tokenize=False)


def _chat_round_trip(base_url: str, model: str, tokenizer) -> None:
    """The unmodified SDK sends an ``exclude_none`` history; the server renders the normalised messages."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    history = sdk_history()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calculator",
                "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}},
            },
        }
    ]
    r = client.chat.completions.create(
        model=model, messages=history, tools=tools, max_tokens=4, temperature=0.0, extra_body={"return_token_ids": True}
    )
    assert r.choices[0].message.role == "assistant"
    prompt_ids = r.choices[0].model_extra["prompt_token_ids"]
    expected = render_prompt_ids(tokenizer, prepare_for_template(history, tokenizer), tools)  # tools never dropped
    assert prompt_ids == list(expected)
    assert r.model_extra["tool_rendering"] == tool_rendering(tokenizer)
    assert '"name": "calculator"' in tokenizer.decode(prompt_ids)  # the call stays in the model's context
    with pytest.raises(openai.BadRequestError) as e:
        bad = history[:2] + [
            {"role": "assistant", "tool_calls": [dict(CALL, function={"name": "calculator", "arguments": "{oops"})]}
        ]
        client.chat.completions.create(model=model, messages=bad, max_tokens=2)
    body = e.value.body if isinstance(e.value.body, dict) else json.loads(e.value.response.text)["error"]
    assert body["param"] == "messages" and "messages[2].tool_calls[0].function.arguments" in body["message"]


def test_server_takes_sdk_history_on_tiny_model(embedded_server, tiny_model_path):
    from transformers import AutoTokenizer

    dep = embedded_server(max_model_len=512, max_batch_size=4)
    _chat_round_trip(dep.base_url, tiny_model_path, AutoTokenizer.from_pretrained(tiny_model_path))


@pytest.mark.slow
def test_server_takes_sdk_history_on_smollm2(tmp_path):
    """SmolLM2's template reads only ``content``: the call is written into it, nothing fails."""
    from transformers import AutoTokenizer

    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.models import resolve_model
    from training.utils import DeployConfig, EngineConfig

    path = resolve_model("smollm2")
    tok = AutoTokenizer.from_pretrained(path)
    assert not template_renders_tool_calls(tok)
    cfg = DeployConfig(engine_config=EngineConfig(max_model_len=512, max_batch_size=4))
    with EmbeddedDeployment(path, cfg, log_file=str(tmp_path / "server.log")) as dep:
        _chat_round_trip(dep.base_url, path, tok)
