"""The tool-call parsers by name, and which one a chat template means (``select_tool_parser``).

| name | family | a call as the model writes it |
| --- | --- | --- |
| ``hermes`` (``qwen``) | Hermes, Qwen2.5, Qwen3 | ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` |
| ``llama3_json`` | Llama 3.1 / 3.2 / 3.3 | ``{"name": ..., "parameters": {...}}``, bare or after ``<|python_tag|>`` |
| ``mistral`` | Mistral | ``[TOOL_CALLS][{"name": ..., "arguments": {...}, "id": ...}]`` |
| ``qwen3_coder`` | Qwen3-Coder | ``<tool_call><function=NAME><parameter=P>V</parameter></function></tool_call>`` |
| ``gemma`` | Gemma | ```` ```tool_code\\nname(p="v")\\n``` ````, or a bare ``[f(a=1), g(b=2)]`` reply |
| ``functiongemma`` | FunctionGemma | ``<start_function_call>call:NAME{p:<escape>v<escape>}<end_function_call>`` |
| ``json`` | any (agents) | the whole reply is one JSON call object or a list of them |

``auto`` (the server's default, ``EngineConfig.tool_call_parser``) reads the chat template: the families whose
``template_markers`` it contains, less those another match ``refines`` (Qwen3-Coder's templates also write
``<tool_call>``); exactly one left is the choice, anything else (none, or several) is ``hermes``, the format
this package's own templates and system-prompt fallback write.
"""

from __future__ import annotations

from typing import Any

from training.openai_api.tool_parsers.base import ToolParser
from training.openai_api.tool_parsers.function_gemma import FunctionGemmaToolParser
from training.openai_api.tool_parsers.gemma import GemmaToolParser
from training.openai_api.tool_parsers.hermes import HermesToolParser
from training.openai_api.tool_parsers.json_reply import JsonToolParser
from training.openai_api.tool_parsers.llama3 import Llama3JsonToolParser
from training.openai_api.tool_parsers.mistral import MistralToolParser
from training.openai_api.tool_parsers.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "gemma": GemmaToolParser,
    "functiongemma": FunctionGemmaToolParser,
    "json": JsonToolParser,
}
"""Every parser by name (``qwen`` is an alias of ``hermes``)."""

AUTO = "auto"
DEFAULT_PARSER = "hermes"
"""What ``auto`` picks when the template does not name one family."""
TOOL_CALL_PARSERS = (AUTO, *PARSERS)
"""The values ``EngineConfig.tool_call_parser`` / ``--tool-call-parser`` take."""


def get_tool_parser(name: str) -> ToolParser:
    """A parser by name (see ``PARSERS``); ValueError naming the valid names for any other."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ValueError(f"tool_parser: {name!r} is not one of {sorted(PARSERS)}") from None


def detect_tool_parser(chat_template: Any) -> list[str]:
    """The parser names whose family ``chat_template`` (a string, or a dict of named templates) marks, most
    specific only (see the module docstring); aliases are left out."""
    if isinstance(chat_template, dict):
        text = "\n".join(t for t in chat_template.values() if isinstance(t, str))
    else:
        text = chat_template if isinstance(chat_template, str) else ""
    names = [n for n, cls in PARSERS.items() if cls.name == n and any(m in text for m in cls.template_markers)]
    refined = {r for n in names for r in PARSERS[n].refines}
    return [n for n in names if n not in refined]


def select_tool_parser(setting: str, chat_template: Any) -> tuple[ToolParser, str]:
    """(the parser, why: a line for the start-up log) for a server's ``tool_call_parser`` ``setting``.

    A name picks that parser; ``auto`` picks the one family ``detect_tool_parser`` finds, else ``hermes``.
    ValueError naming the valid settings for anything else."""
    if setting != AUTO:
        if setting not in PARSERS:
            raise ValueError(f"tool_call_parser: {setting!r} is not one of {list(TOOL_CALL_PARSERS)}")
        return PARSERS[setting](), f"tool-call parser: {setting} (set by tool_call_parser)"
    found = detect_tool_parser(chat_template)
    if len(found) == 1:
        return PARSERS[found[0]](), f"tool-call parser: {found[0]} (auto: the chat template writes its format)"
    why = f"the chat template marks {found}" if found else "the chat template marks no known family"
    return (
        PARSERS[DEFAULT_PARSER](),
        f"tool-call parser: {DEFAULT_PARSER} (auto: {why}; set --tool-call-parser to choose)",
    )
