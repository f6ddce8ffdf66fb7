"""The server's tool-call parser is chosen per server (``--tool-call-parser`` / ``EngineConfig.tool_call_parser``).

The real server on the tiny model given Mistral's chat template (slow: two server starts): ``auto`` picks
``mistral`` from the template and says so in its start-up log; a forced call (``tool_choice`` required, constrained decoding) is then written in
Mistral's format by the model and comes back as ``tool_calls`` (whole and streamed) with Mistral's 9-character
ids, which the template accepts in the next turn. A server told ``llama3_json`` over the tiny model's own
(Hermes) template writes and reads Llama's format instead. A format that is not JSON cannot be forced (400),
and an unknown parser name stops the server's command line naming the valid ones.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import requests

from training.deployment.engine.constraints import missing_library
from training.openai_api.chat_templates import install_template

needs_library = pytest.mark.skipif(missing_library() is not None, reason="llguidance (training[constrained]) missing")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["utc", "cet"]}, "hours": {"enum": [1, 2, 3]}},
                "required": ["zone", "hours"],
                "additionalProperties": False,
            },
        },
    }
]
MESSAGES = [{"role": "user", "content": "What time is it in utc?"}]


@pytest.fixture(scope="module")
def mistral_model(tiny_model_path, tmp_path_factory) -> str:
    """A copy of the tiny model whose chat template is Mistral's (``chat_templates/mistral.jinja``)."""
    folder = tmp_path_factory.mktemp("tiny-mistral") / "model"
    shutil.copytree(tiny_model_path, folder)
    install_template(folder, "mistral")
    return str(folder)


def _chat(server, **body) -> requests.Response:
    body = {"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "seed": 0, **body}
    return requests.post(server.base_url + "/v1/chat/completions", json=body, timeout=300)


def _streamed_calls(server, **body) -> tuple[list[dict], str]:
    """(the tool calls assembled from the stream's deltas, the finish reason)."""
    r = requests.post(
        server.base_url + "/v1/chat/completions",
        json={"messages": MESSAGES, "tools": TOOLS, "max_tokens": 120, "seed": 0, "stream": True, **body},
        stream=True,
        timeout=300,
    )
    assert r.status_code == 200, r.text
    calls: dict[int, dict] = {}
    finish = None
    for line in r.iter_lines():
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        for choice in json.loads(line[6:])["choices"]:
            finish = choice.get("finish_reason") or finish
            for tc in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
                entry["id"] = tc.get("id") or entry["id"]
                entry["name"] = tc.get("function", {}).get("name") or entry["name"]
                entry["arguments"] += tc.get("function", {}).get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish


@pytest.mark.slow  # two server starts and constrained generation: ~40 s on 2 busy cores
@needs_library
def test_each_server_reads_calls_with_its_own_parser(embedded_server, mistral_model):
    """``auto`` over Mistral's template is ``mistral``; ``llama3_json`` named over the Hermes template wins."""
    mistral, llama = embedded_server.together(
        {"model": mistral_model, "max_model_len": 1024, "max_batch_size": 4},
        {"tool_call_parser": "llama3_json", "max_model_len": 1024, "max_batch_size": 4},
    )
    _check_mistral(mistral)
    _check_llama(llama)


def _check_mistral(server) -> None:
    log = Path(server.cfg.log_file).read_text()
    assert "tool-call parser: mistral (auto: the chat template writes its format)" in log
    r = _chat(server, tool_choice="required", return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    from transformers import AutoTokenizer

    written = AutoTokenizer.from_pretrained(server.model).decode(choice["token_ids"])
    assert written.startswith('[TOOL_CALLS][{"name": "get_time", "arguments": {'), written  # the model wrote Mistral's
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    assert [c["function"]["name"] for c in calls] == ["get_time"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert args["zone"] in ("utc", "cet") and args["hours"] in (1, 2, 3)
    assert len(calls[0]["id"]) == 9 and calls[0]["id"].isalnum()

    streamed, finish = _streamed_calls(server, tool_choice="required")
    assert finish == "tool_calls" and [c["name"] for c in streamed] == ["get_time"]
    assert json.loads(streamed[0]["arguments"]) == args  # same seed, same tokens
    assert len(streamed[0]["id"]) == 9 and streamed[0]["id"].isalnum()

    # the next turn: Mistral's template refuses ids that are not 9 alphanumerics; the server's ids pass
    history = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "12:00"},
    ]
    r = _chat(server, messages=history, max_tokens=2)
    assert r.status_code == 200, r.text


def _check_llama(server) -> None:
    assert "tool-call parser: llama3_json (set by tool_call_parser)" in Path(server.cfg.log_file).read_text()
    r = _chat(server, tool_choice={"type": "function", "function": {"name": "get_time"}}, return_token_ids=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    from transformers import AutoTokenizer

    written = AutoTokenizer.from_pretrained(server.model).decode(choice["token_ids"])
    assert written.startswith('{"name": "get_time", "parameters": {'), written
    calls = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and [c["function"]["name"] for c in calls] == ["get_time"]
    assert set(json.loads(calls[0]["function"]["arguments"])) == {"zone", "hours"}


def test_a_format_that_is_not_json_cannot_be_forced():
    from training.deployment.server.structured import StructuredOutputError, tool_choice
    from training.openai_api.tool_parsers import get_tool_parser

    with pytest.raises(StructuredOutputError, match="tool_call_parser 'qwen3_coder'.*not JSON") as e:
        tool_choice({"tool_choice": "required"}, TOOLS, get_tool_parser("qwen3_coder"))
    assert e.value.param == "tool_choice"
    assert tool_choice({"tool_choice": "auto"}, TOOLS, get_tool_parser("qwen3_coder")) == (True, None)


def test_an_unknown_parser_stops_the_command_line_naming_the_valid_ones(tiny_model_path):
    from training.deployment.serve import build_parser, engine_config_from_args

    args = build_parser().parse_args(["--model", tiny_model_path, "--tool-call-parser", "mistrel"])
    with pytest.raises(SystemExit, match="tool_call_parser: 'mistrel' is not one of .*'mistral'.*'qwen3_coder'"):
        engine_config_from_args(args)
    ok = build_parser().parse_args(["--model", tiny_model_path, "--tool-call-parser", "gemma"])
    assert engine_config_from_args(ok).tool_call_parser == "gemma"
