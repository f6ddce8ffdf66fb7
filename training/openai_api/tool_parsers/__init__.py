"""Tool-call parsers by model family (model text -> ``ToolCall`` list), and tool schemas -> the prompt.

On the ground floor because both the inference server (``deployment/server``: tool calls in chat responses, the
server's parser chosen by ``EngineConfig.tool_call_parser``) and the agents (``training/agents``) parse the same
formats. One module per family (``hermes``, ``llama3``, ``mistral``, ``qwen3_coder``, ``gemma``, ``function_gemma``, ``json_reply``),
the contract in ``base``, names and template detection in ``registry``, prompt rendering in ``rendering``.

A block that is present but malformed never raises: it becomes an entry of ``ParsedCalls.errors``, which the
agent shows the model next turn (``format_parse_error``).
"""

from training.openai_api.tool_parsers.base import (
    HERMES_EXAMPLE,
    ParsedCalls,
    ToolCall,
    ToolParser,
    call_from_object,
    format_parse_error,
    to_openai_tool_calls,
)
from training.openai_api.tool_parsers.function_gemma import FunctionGemmaToolParser
from training.openai_api.tool_parsers.gemma import GemmaToolParser
from training.openai_api.tool_parsers.hermes import HermesToolParser
from training.openai_api.tool_parsers.json_reply import JsonToolParser
from training.openai_api.tool_parsers.llama3 import Llama3JsonToolParser
from training.openai_api.tool_parsers.mistral import MistralToolParser
from training.openai_api.tool_parsers.qwen3_coder import Qwen3CoderToolParser
from training.openai_api.tool_parsers.registry import (
    AUTO,
    DEFAULT_PARSER,
    PARSERS,
    TOOL_CALL_PARSERS,
    detect_tool_parser,
    get_tool_parser,
    select_tool_parser,
)
from training.openai_api.tool_parsers.rendering import (
    TOOL_RENDERINGS,
    messages_with_tools,
    render_prompt_ids,
    template_renders_tools,
    tool_rendering,
    tools_system_text,
)

__all__ = [
    "AUTO",
    "DEFAULT_PARSER",
    "FunctionGemmaToolParser",
    "GemmaToolParser",
    "HERMES_EXAMPLE",
    "HermesToolParser",
    "JsonToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "PARSERS",
    "ParsedCalls",
    "Qwen3CoderToolParser",
    "TOOL_CALL_PARSERS",
    "TOOL_RENDERINGS",
    "ToolCall",
    "ToolParser",
    "call_from_object",
    "detect_tool_parser",
    "format_parse_error",
    "get_tool_parser",
    "messages_with_tools",
    "render_prompt_ids",
    "select_tool_parser",
    "template_renders_tools",
    "to_openai_tool_calls",
    "tool_rendering",
    "tools_system_text",
]
