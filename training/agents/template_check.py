"""Template check on the command line: does re-rendering a conversation only append?

    python -m training.agents.template_check MODEL [--chat-template-kwargs '{"enable_thinking": false}']

``MODEL`` is ``tiny``, ``smollm2`` (the offline aliases of ``training.models.resolve_model``), a
folder or a hub id. Prints one line per assistant turn of the scripted conversation (tools,
``<think>``, two tool messages in a row, a tool-call-only turn with ``content: None``, a follow-up
user turn), then whether the template renders ``tools``, and exits 1 when a turn drifts or the
template drops tools. The check itself lives on the ground floor (``training/openai_api/template_check.py``)
because the proxy runs it too; its names are re-exported here.
"""

from __future__ import annotations

import argparse
import json
import sys

from training.openai_api.template_check import (
    SCRIPT,
    SCRIPT_TOOLS,
    TemplateCheckError,
    TurnCheck,
    check_template_appends,
    run_template_check,
    tools_dropped_message,
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", help="'tiny', 'smollm2', a folder or a hub id whose tokenizer to check")
    p.add_argument(
        "--chat-template-kwargs",
        default="{}",
        type=json.loads,
        help="JSON object passed to apply_chat_template, e.g. '{\"enable_thinking\": false}'",
    )
    a = p.parse_args(argv)
    if not isinstance(a.chat_template_kwargs, dict):
        p.error("--chat-template-kwargs must be a JSON object")
    from transformers import AutoTokenizer

    from training.models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(a.model))
    checks = check_template_appends(tokenizer, **a.chat_template_kwargs)
    for c in checks:
        print(f"assistant message {c.turn}: {'appends' if c.appends else 'DRIFTS: ' + c.reason}")
    dropped = tools_dropped_message(tokenizer, "tools")
    print(dropped or "tools: rendered by the chat template")
    return 0 if all(c.appends for c in checks) and not dropped else 1


__all__ = [
    "SCRIPT",
    "SCRIPT_TOOLS",
    "TemplateCheckError",
    "TurnCheck",
    "check_template_appends",
    "main",
    "run_template_check",
    "tools_dropped_message",
]

if __name__ == "__main__":
    sys.exit(main())
