"""Every tool-call parser reads its family's real chat-template output.

For each family, a conversation with tools and an assistant tool-call turn is rendered by transformers'
``apply_chat_template`` through that family's template (``training/openai_api/chat_templates``) on the tiny
model's tokenizer; the assistant turn's text (what the model would have written) is parsed by the family's
parser, whole and streamed in small pieces through the server's ``ToolCallStream``. Malformed calls stay text.
"""

from __future__ import annotations

import json

import pytest

from training.deployment.server.bodies import parse_tool_calls
from training.deployment.server.streaming import ToolCallStream
from training.openai_api.chat_templates import FAMILIES, family_template
from training.openai_api.tool_parsers import PARSERS, detect_tool_parser, get_tool_parser, select_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
        },
    },
]
CALLS = [
    ("get_weather", {"city": "Oslo", "days": 3, "metric": True, "hours": [6, 12]}),
    ("add", {"a": 1.5, "b": -2}),
]
PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo, and 1.5 + -2?"}]
TURN_END = {
    "hermes": "<|im_end|>",
    "qwen3_coder": "<|im_end|>",
    "llama3_json": "<|eot_id|>",
    "mistral": "<|im_end|>",  # the tiny tokenizer's eos_token, which Mistral's template writes
    "gemma": "<end_of_turn>",
    "functiongemma": "<end_of_turn>",
}
IDS = ["abcDEF123", "xyz987QRS"]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


def assistant_text(tokenizer, family: str, calls=CALLS, content: str = "") -> str:
    """The assistant turn of a rendered conversation: the text after the prompt, up to the turn's end."""
    tokenizer.chat_template = family_template(family)
    turn = {
        "role": "assistant",
        "content": content,
        "tool_calls": [
            {"id": IDS[i], "type": "function", "function": {"name": n, "arguments": a}}
            for i, (n, a) in enumerate(calls)
        ],
    }
    generation = family != "mistral"  # Mistral's prompt ends at [/INST]: no assistant header
    prompt = tokenizer.apply_chat_template(PROMPT, tools=TOOLS, tokenize=False, add_generation_prompt=generation)
    full = tokenizer.apply_chat_template(PROMPT + [turn], tools=TOOLS, tokenize=False)
    assert full.startswith(prompt), f"{family}: rendering the assistant turn changed the prompt"
    reply = full[len(prompt) :]
    assert TURN_END[family] in reply
    return reply[: reply.index(TURN_END[family])]


def test_every_family_has_a_template_and_a_parser():
    assert set(FAMILIES) == {"hermes", "llama3_json", "mistral", "qwen3_coder", "gemma", "functiongemma"}
    assert set(FAMILIES) <= set(PARSERS)


@pytest.mark.parametrize("family", FAMILIES)
def test_parser_reads_its_familys_template_output(tokenizer, family):
    calls = CALLS[:1] if family == "llama3_json" else CALLS  # parallel calls only where the format has them
    text = assistant_text(tokenizer, family, calls)
    parsed = get_tool_parser(family).parse(text, id_prefix="call_7_", tools=TOOLS)
    assert parsed.errors == []
    assert [(c.name, c.arguments) for c in parsed.calls] == calls
    assert parsed.content == ""
    ids = [c.id for c in parsed.calls]
    if family == "mistral":
        assert ids == IDS[: len(calls)]  # the ids the model wrote (its template's 9-alphanumeric ids)
    else:
        assert ids == [f"call_7_{i}" for i in range(len(calls))]


@pytest.mark.parametrize("family", ["hermes", "qwen3_coder", "gemma", "functiongemma"])
def test_content_before_the_calls_is_kept(tokenizer, family):
    text = assistant_text(tokenizer, family, CALLS[:1], content="Let me look.")
    parsed = get_tool_parser(family).parse(text, tools=TOOLS)
    assert parsed.content == "Let me look." and [c.name for c in parsed.calls] == ["get_weather"]


@pytest.mark.parametrize("family", FAMILIES)
def test_template_names_its_parser(family):
    assert detect_tool_parser(family_template(family)) == [family]
    parser, why = select_tool_parser("auto", family_template(family))
    assert parser.name == family and "auto" in why


def test_auto_falls_back_to_hermes_and_unknown_names_are_refused(tiny_model_path):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model_path).chat_template
    assert select_tool_parser("auto", own)[0].name == "hermes"  # the tiny model's own template: <tool_call>
    parser, why = select_tool_parser("auto", "{{ messages[0].content }}")
    assert parser.name == "hermes" and "no known family" in why
    assert select_tool_parser("mistral", own)[0].name == "mistral"  # a name wins over the template
    with pytest.raises(ValueError, match="'mistrel' is not one of .*'mistral'"):
        select_tool_parser("mistrel", own)


def stream_deltas(family: str, text: str, piece: int = 3) -> tuple[str, list[dict]]:
    """(content, OpenAI tool calls) that the server's stream splitter sends for ``text`` fed ``piece`` chars at a time."""
    stream = ToolCallStream(get_tool_parser(family), TOOLS)
    deltas = [d for i in range(0, len(text), piece) for d in stream.feed(text[i : i + piece])] + stream.finish()
    content = "".join(d.get("content", "") for d in deltas)
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            entry["id"] = tc.get("id", entry["id"])
            entry["name"] = tc.get("function", {}).get("name") or entry["name"]
            entry["arguments"] += tc.get("function", {}).get("arguments", "")
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("family", FAMILIES)
def test_streamed_calls_equal_the_whole_responses(tokenizer, family):
    calls = CALLS[:1] if family == "llama3_json" else CALLS
    text = assistant_text(tokenizer, family, calls)
    content, streamed = stream_deltas(family, text)
    whole_content, whole = parse_tool_calls(text, get_tool_parser(family), TOOLS)
    assert content == whole_content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed] == calls
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole] == calls
    assert len({c["id"] for c in streamed}) == len(calls)


MALFORMED = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo"',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city"',
    "qwen3_coder": "<tool_call>\n<parameter=city>\nOslo\n</parameter>\n</tool_call>",
    "gemma": "```tool_code\nget_weather(city=os.environ['HOME'])\n```",
    "functiongemma": "<start_function_call>call:get_weather{city:<escape>Oslo}<end_function_call>",
}


@pytest.mark.parametrize("family", FAMILIES)
def test_malformed_calls_stay_text(family):
    text = MALFORMED[family]
    parsed = get_tool_parser(family).parse(text, tools=TOOLS)
    assert parsed.calls == [] and len(parsed.errors) == 1
    assert parse_tool_calls(text, get_tool_parser(family), TOOLS) == (text, [])
    content, streamed = stream_deltas(family, text)
    assert streamed == [] and content == text.strip()


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_replies_are_content(family):
    parsed = get_tool_parser(family).parse("It is 12 degrees in Oslo.", tools=TOOLS)
    assert parsed.calls == [] and parsed.errors == [] and parsed.content == "It is 12 degrees in Oslo."
    assert stream_deltas(family, "It is 12 degrees in Oslo.") == ("It is 12 degrees in Oslo.", [])


def test_special_marker_dropped_by_decoding_still_parses():
    """``[TOOL_CALLS]`` and ``<|python_tag|>`` are special tokens in their families' tokenizers, so a decode with
    ``skip_special_tokens`` drops them: the bare forms parse the same."""
    mistral = get_tool_parser("mistral").parse('[{"name": "add", "arguments": {"a": 1, "b": 2}}]')
    assert [(c.name, c.arguments) for c in mistral.calls] == [("add", {"a": 1, "b": 2})]
    assert len(mistral.calls[0].id) == 9 and mistral.calls[0].id.isalnum()
    tagged = get_tool_parser("llama3_json").parse('Sure.<|python_tag|>{"name": "add", "parameters": {"a": 1}}')
    assert tagged.content == "Sure." and [(c.name, c.arguments) for c in tagged.calls] == [("add", {"a": 1})]
    newer = get_tool_parser("mistral").parse('[TOOL_CALLS]add[ARGS]{"a": 1}[TOOL_CALLS]add[ARGS]{"a": 2}')
    assert [c.arguments for c in newer.calls] == [{"a": 1}, {"a": 2}]


def test_gemma_never_runs_the_code():
    parsed = get_tool_parser("gemma").parse("```tool_code\n__import__('os').system('touch /tmp/x')\n```")
    assert parsed.calls == [] and "is not a function name" in parsed.errors[0]


def test_a_parse_error_tells_the_model_its_familys_format():
    from training.openai_api.tool_parsers import format_parse_error

    assert "<tool_call>" in format_parse_error("bad JSON")  # the Hermes default
    for family in FAMILIES:
        parser = get_tool_parser(family)
        assert parser.example and parser.example in format_parse_error("bad JSON", parser)


def test_gemma_reads_the_bare_call_list_of_googles_prompt():
    text = '[get_weather(city="Oslo", days=3), add(a=1.5, b=-2)]'
    parsed = get_tool_parser("gemma").parse(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [
        ("get_weather", {"city": "Oslo", "days": 3}),
        ("add", {"a": 1.5, "b": -2}),
    ]
    content, streamed = stream_deltas("gemma", text)
    assert content == "" and [c["name"] for c in streamed] == ["get_weather", "add"]
    assert get_tool_parser("gemma").parse("[1] see the notes").content == "[1] see the notes"
    assert stream_deltas("gemma", "[1] see the notes") == ("[1] see the notes", [])


def test_functiongemma_reads_calls_whose_special_tokens_were_dropped():
    """Without ``<start_function_call>`` and ``<escape>`` (special tokens, skipped in decoding), strings are bare."""
    parsed = get_tool_parser("functiongemma").parse("call:get_weather{city:Oslo,days:3,metric:true,hours:[6,12]}")
    assert [(c.name, c.arguments) for c in parsed.calls] == CALLS[:1]
    assert stream_deltas("functiongemma", "call:add{a:1.5,b:-2}")[1][0]["name"] == "add"
