"""Which request fields the server honours, accepts as metadata, or refuses.

No field is silently ignored when it could change what is generated:

- ``HONOURED``: implemented (parsed and type-checked in ``protocol.py``).
- ``METADATA``: accepted and ignored; they never change the tokens (``user``, ``metadata``...).
- ``UNSUPPORTED``: known OpenAI / vLLM fields this server does not implement. Their default value
  (absent, null, or the value that means "off") is accepted; any other value is refused with a
  400 naming the field.
- Any other field is refused with a 400 naming it: an unknown field may be a sampling field of
  another server, and ignoring it would return tokens the client did not ask for.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

COMMON = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "n",
        "stream",
        "stream_options",
        "stop",
        "seed",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "best_of",
        # vLLM extras
        "top_k",
        "min_p",
        "repetition_penalty",
        "min_tokens",
        "ignore_eos",
        "stop_token_ids",
        "include_stop_str_in_output",
        "return_token_ids",
        "return_tokens_as_token_ids",
        "response_format",
    }
)
HONOURED = {
    "completions": COMMON | {"prompt", "logprobs", "add_special_tokens", "tools", "tool_choice", "prompt_logprobs"},
    "chat": COMMON
    | {
        "messages",
        "max_completion_tokens",
        "logprobs",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "chat_template_kwargs",
        "add_generation_prompt",
        "continue_final_message",
        "prompt_logprobs",  # null only: protocol.py refuses a value, naming /v1/completions
    },
}
METADATA = frozenset(
    {"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "request_id"}
)


def _off(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


def _is(*defaults: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == d and type(v) is type(d) for d in defaults)


UNSUPPORTED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # name: (is the value harmless?, what is not supported)
    "echo": (_off, "echoing the prompt"),
    "suffix": (_off, "suffix insertion"),
    "truncate_prompt_tokens": (_off, "prompt truncation"),
    "use_beam_search": (_off, "beam search"),
    "length_penalty": (_is(1, 1.0), "beam-search length penalty"),
    "allowed_token_ids": (_off, "allowed_token_ids (use logit_bias)"),
    "bad_words": (_off, "bad_words (use logit_bias)"),
    "guided_json": (_off, "guided decoding"),
    "guided_regex": (_off, "guided decoding"),
    "guided_choice": (_off, "guided decoding"),
    "guided_grammar": (_off, "guided decoding"),
    "guided_decoding_backend": (_off, "guided decoding"),
    "guided_whitespace_pattern": (_off, "guided decoding"),
    "structured_outputs": (_off, "structured output"),
    "logits_processors": (_off, "custom logits processors"),
    "skip_special_tokens": (_is(True), "keeping special tokens in the text"),
    "spaces_between_special_tokens": (_is(True), "changing the spacing of special tokens"),
    "priority": (_is(0), "request priorities"),
    "cache_salt": (_off, "cache salts"),
    "kv_transfer_params": (_off, "KV transfer"),
    "vllm_xargs": (_off, "vllm_xargs"),
    "prompt_embeds": (_off, "prompt embeddings"),
    "mm_processor_kwargs": (_off, "multimodal inputs"),
    "chat_template": (_off, "request-supplied chat templates (the model's own template is used)"),
    "documents": (_off, "documents for the chat template"),
    "functions": (_off, "the deprecated 'functions' (use 'tools')"),
    "function_call": (_off, "the deprecated 'function_call' (use 'tool_choice')"),
    "modalities": (lambda v: v is None or v == ["text"], "modalities other than ['text']"),
    "audio": (_off, "audio output"),
    "prediction": (_off, "predicted outputs"),
    "reasoning_effort": (_off, "reasoning_effort"),
    "verbosity": (_off, "verbosity"),
    "web_search_options": (_off, "web search"),
}
"""Refused unless the value is the default. ``echo`` etc. are refused on both endpoints."""


def refusal(body: dict, endpoint: str) -> Optional[tuple[str, str]]:
    """The first field of ``body`` this server will not serve as asked: (field, message), or None."""
    for name, value in body.items():
        if name in HONOURED[endpoint] or name in METADATA:
            continue
        if name in UNSUPPORTED:
            harmless, what = UNSUPPORTED[name]
            if harmless(value):
                continue
            return name, f"'{name}'={value!r} is not supported by this server: {what} is not implemented"
        return name, (
            f"unknown field '{name}': refused rather than ignored, since it could change what is "
            "generated (see the deployment README for the fields this server honours)"
        )
    return None
