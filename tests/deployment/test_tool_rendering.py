"""Tools always reach the model: the chat template's ``tools``, or the system-prompt fallback.

The real server on the tiny model (its template renders ``tools``), on the tiny model with a
content-only template (SmolLM2's kind, which ignores ``tools``), and on SmolLM2 itself (slow):
a request with tools has the tool names and schemas in its prompt ids, one without has none, and
the response says how they were rendered (``tool_rendering``). The template check fails a
template that drops tools.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from training.openai_api.chat_messages import prepare_for_template
from training.openai_api.tool_parsers import render_prompt_ids, template_renders_tools, tool_rendering

CONTENT_ONLY_TEMPLATE = (
    "{% for m in messages %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Reads only role and content, as SmolLM2's template does: ``tools`` never appear in its output."""

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city, in degrees Celsius.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"}]


def _content_only_model(tiny_model_path: str, tmp_path: Path) -> str:
    """A copy of the tiny model whose chat template ignores ``tools``."""
    folder = tmp_path / "tiny-content-only"
    shutil.copytree(tiny_model_path, folder)
    (folder / "chat_template.jinja").write_text(CONTENT_ONLY_TEMPLATE)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    return str(folder)


def _check_server(base_url: str, model: str, tokenizer, expected_rendering: str, log_file: Path) -> None:
    """With tools: names and schemas in the prompt ids (exactly the fallback-aware rendering); without: none."""
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    extra = {"return_token_ids": True}
    for _ in range(2):  # twice: the fallback is logged once per server, not per request
        r = client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, max_tokens=3, temperature=0.0, extra_body=extra
        )
        prompt_ids = r.model_extra["prompt_token_ids"]
        text = tokenizer.decode(prompt_ids)
        assert "get_weather" in text and "Weather in a city, in degrees Celsius." in text and '"city"' in text
        assert prompt_ids == render_prompt_ids(tokenizer, prepare_for_template(MESSAGES, tokenizer), TOOLS)
        assert r.model_extra["tool_rendering"] == expected_rendering
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3, extra_body=extra)
    plain_text = tokenizer.decode(plain.model_extra["prompt_token_ids"])
    assert "get_weather" not in plain_text and "<tools>" not in plain_text
    assert "tool_rendering" not in plain.model_extra
    assert len(plain.model_extra["prompt_token_ids"]) < len(prompt_ids)
    chunks = list(
        client.chat.completions.create(
            model=model, messages=MESSAGES, tools=TOOLS, max_tokens=3, stream=True, extra_body=extra
        )
    )
    assert chunks and all(c.model_extra["tool_rendering"] == expected_rendering for c in chunks)
    streamed_prompt = next(c.choices[0].model_extra["prompt_token_ids"] for c in chunks if c.choices)
    assert streamed_prompt == prompt_ids
    fallback_lines = [line for line in log_file.read_text().splitlines() if "ignores 'tools'" in line]
    assert len(fallback_lines) == (1 if expected_rendering == "system_prompt" else 0)


def _serve_and_check(model: str, tmp_path: Path, expected_rendering: str) -> None:
    from transformers import AutoTokenizer

    from training.deployment.backends.embedded import EmbeddedDeployment
    from training.utils import DeployConfig, EngineConfig

    tokenizer = AutoTokenizer.from_pretrained(model)
    assert tool_rendering(tokenizer) == expected_rendering
    cfg = DeployConfig(engine_config=EngineConfig(max_model_len=1024, max_batch_size=4))
    log_file = tmp_path / "server.log"
    with EmbeddedDeployment(model, cfg, log_file=str(log_file)) as dep:
        _check_server(dep.base_url, model, tokenizer, expected_rendering, log_file)


def test_tools_reach_the_prompt_through_a_template_that_renders_them(tiny_model_path, tmp_path):
    _serve_and_check(tiny_model_path, tmp_path, "template")


def test_tools_reach_the_prompt_when_the_template_ignores_them(tiny_model_path, tmp_path):
    _serve_and_check(_content_only_model(tiny_model_path, tmp_path), tmp_path, "system_prompt")


@pytest.mark.slow
def test_tools_reach_smollm2_through_the_system_prompt_fallback(tmp_path):
    from training.models import resolve_model

    _serve_and_check(resolve_model("smollm2"), tmp_path, "system_prompt")


def test_fallback_extends_the_agents_own_system_message(tiny_model_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    tok.chat_template = CONTENT_ONLY_TEMPLATE
    assert not template_renders_tools(tok) and tool_rendering(tok) == "system_prompt"
    text = tok.decode(render_prompt_ids(tok, MESSAGES, TOOLS))
    assert text.count("<|im_start|>system") == 1 and text.index("Be brief.") < text.index("get_weather")
    no_system = tok.decode(render_prompt_ids(tok, MESSAGES[1:], TOOLS))
    assert no_system.startswith("<|im_start|>system\n# Tools") and "get_weather" in no_system


def test_template_check_fails_a_template_that_drops_tools(tiny_model_path, caplog):
    from transformers import AutoTokenizer

    from training.openai_api.template_check import TemplateCheckError, run_template_check, tools_dropped_message

    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    assert tools_dropped_message(tok) == ""
    tok.chat_template = CONTENT_ONLY_TEMPLATE
    with pytest.raises(TemplateCheckError, match="ignores 'tools'.*system-prompt fallback"):
        run_template_check(tok, "error", where="probe")
    run_template_check(tok, "warn", where="probe")
    assert "probe: the chat template ignores 'tools'" in caplog.text
