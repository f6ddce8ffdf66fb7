"""OpenAI-compatible request parsing for the deployment server.

Parsing turns a JSON body into a ``ParsedRequest`` (token-id prompts + ``SamplingParams``)
or raises ``RequestError`` naming the offending field; the server answers that with
400 ``{"error": {"message", "type": "invalid_request_error", "param"}}``. Every field is
honoured, accepted as metadata, or refused (``fields.py``); known fields are type-checked here
and range-checked by the engine's ``validate_request``, so a request that reaches the engine
can always be sampled. Responses are built in ``bodies.py`` (whole) and ``streaming.py``
(server-sent events).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import Any, Optional

from training.deployment.engine.requests import MAX_TOP_LOGPROBS, EngineError, SamplingParams, validate_request
from training.deployment.server.fields import refusal
from training.deployment.server.request_error import RequestError
from training.deployment.server.limits import (
    DEFAULT_LIMITS,
    RequestLimits,
    check_sequences,
    check_stop,
    check_template_kwargs,
)
from training.deployment.server.structured import StructuredOutputError, chat_constraint, completion_constraint
from training.openai_api.chat_messages import ChatMessageError, prepare_for_template
from training.openai_api.tool_parsers import ToolParser, messages_with_tools, tool_rendering

MAX_N = 256
"""Upper bound on ``n`` (choices per prompt) in one request."""
MAX_PROMPTS = 256
"""Prompts one /v1/completions request may carry."""
MAX_CHARS_PER_TOKEN = 32
"""A prompt's text may have at most this many characters per token of the context length; longer text
cannot fit and is refused before it is tokenized (tokenizing a 10 MB prompt would stall the server)."""


@dataclass
class ParsedRequest:
    """A validated generation request: prompts as token ids, ``n`` choices each."""

    prompts: list[list[int]]
    """Token ids of each prompt (completions may carry several; chat carries one)."""
    n: int
    """Choices per prompt; each is one engine request, run concurrently."""
    params: SamplingParams
    """Sampling parameters shared by every choice (``seed`` is set per choice by ``params_for``)."""
    seed: Optional[int]
    """Base seed; choice ``i`` uses ``seed + i``."""
    logprobs: Optional[int]
    """None = no logprobs in the response; k >= 0 = sampled-token logprobs plus the k most likely tokens."""
    return_token_ids: bool
    """Add ``token_ids`` and ``prompt_token_ids`` to every choice."""
    model: str
    """The model name echoed in the response."""
    tools: Optional[list[dict]] = None
    """Chat only: the tool schemas; rendered into the prompt (see ``tool_rendering``)."""
    tool_rendering: Optional[str] = None
    """Chat with ``tools``: ``template`` (the chat template rendered them) or ``system_prompt`` (the template
    ignores ``tools``, so the schemas were written into the system message); None without tools."""
    parse_tool_calls: bool = False
    """Chat only: turn the model's calls into ``tool_calls`` (``tools`` given, ``tool_choice`` not "none")."""
    tool_parser: Optional[ToolParser] = None
    """The server's tool-call parser (``EngineConfig.tool_call_parser``; None: Hermes): reads the calls, and
    writes the grammar of a forced one."""
    stream: bool = False
    """Answer with server-sent events (OpenAI chunks) instead of one JSON body."""
    include_usage: bool = False
    """Streaming: end with a chunk that carries ``usage`` (``stream_options.include_usage``)."""
    tokens_as_ids: bool = False
    """Token strings in logprobs are ``token_id:N`` (vLLM's ``return_tokens_as_token_ids``)."""
    prompt_logprobs: Optional[int] = None
    """Completions only (vLLM's field): k >= 0 adds ``prompt_logprobs`` to every choice, each prompt token's logprob
    given the tokens before it plus the k likeliest tokens there, from a scoring forward apart from generation
    (``engine/scoring.py``), of softmax(logits / ``temperature``) (raw at 1 or 0; vLLM's are always raw). With
    ``max_tokens: 0`` nothing is generated (``params.max_tokens`` is then 0)."""

    def params_for(self, choice_index: int) -> SamplingParams:
        """Sampling params of choice ``choice_index`` (seed + index when a seed was given)."""
        seed = None if self.seed is None else self.seed + choice_index
        return replace(self.params, seed=seed)


# ---------------------------------------------------------------- field readers


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(
    body: dict, name: str, default: Optional[int], lo: Optional[int] = None, hi: Optional[int] = None
) -> Optional[int]:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise RequestError(f"'{name}' must be an integer, got {type(v).__name__} {v!r}", name)
    if lo is not None and v < lo:
        raise RequestError(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise RequestError(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not _is_number(v) or not math.isfinite(v):
        raise RequestError(f"'{name}' must be a finite number, got {type(v).__name__} {v!r}", name)
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"'{name}' must be a boolean, got {type(v).__name__} {v!r}", name)
    return v


def _stop(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise RequestError("'stop' must be a string or a list of strings", "stop")
    if any(s == "" for s in v):
        raise RequestError("'stop' strings must be non-empty", "stop")
    return v


def _token_ids(ids: Any, vocab_size: int, param: str) -> list[int]:
    if not isinstance(ids, list) or not ids:
        raise RequestError(f"'{param}' must be a non-empty list of token ids", param)
    for i, t in enumerate(ids):
        if not _is_int(t):
            raise RequestError(f"'{param}'[{i}]={t!r} is not an integer token id", param)
        if not 0 <= t < vocab_size:
            raise RequestError(f"'{param}'[{i}]={t} is outside the vocabulary [0, {vocab_size})", param)
    return list(ids)


def _check_model(body: dict, served_names: tuple[str, ...]) -> str:
    model = body.get("model")
    if model is None:
        return served_names[0]
    if not isinstance(model, str):
        raise RequestError(f"'model' must be a string, got {type(model).__name__}", "model")
    if model not in served_names:
        raise RequestError(
            f"The model '{model}' does not exist; this server serves '{served_names[0]}'",
            "model",
            status=404,
            err_type="NotFoundError",
        )
    return served_names[0]


def _logit_bias(body: dict, vocab_size: int) -> dict[int, float]:
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise RequestError("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out = {}
    for key, bias in v.items():
        try:
            tok = int(key)
        except (TypeError, ValueError):
            raise RequestError(f"'logit_bias' key {key!r} is not a token id", "logit_bias") from None
        if not 0 <= tok < vocab_size:
            raise RequestError(f"'logit_bias' key {key!r} is outside the vocabulary [0, {vocab_size})", "logit_bias")
        if not _is_number(bias) or not math.isfinite(bias):
            raise RequestError(f"'logit_bias'[{key!r}] must be a finite number, got {bias!r}", "logit_bias")
        out[tok] = float(bias)
    return out


def _top_k(body: dict) -> int:
    k = _int(body, "top_k", 0, lo=-1)
    return 0 if k == -1 else k  # vLLM: -1 and 0 both mean "all tokens"


def _stream_options(body: dict, stream: bool) -> bool:
    """``include_usage`` from ``stream_options`` (only valid with ``stream``)."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise RequestError("'stream_options' is only allowed with 'stream': true", "stream_options")
    if not isinstance(opts, dict):
        raise RequestError("'stream_options' must be an object", "stream_options")
    for key, value in opts.items():
        if key == "include_usage":
            if not isinstance(value, bool):
                raise RequestError("'stream_options.include_usage' must be a boolean", "stream_options")
        elif value not in (None, False):
            raise RequestError(f"'stream_options.{key}' is not supported by this server", "stream_options")
    return bool(opts.get("include_usage"))


def _sampling(
    body: dict,
    prompt_len: int,
    max_model_len: int,
    vocab_size: int,
    top_logprobs: int,
    default_max_tokens: Optional[int],
    max_tokens_names: tuple[str, ...],
    num_prompts: int,
    limits: RequestLimits,
) -> tuple[SamplingParams, Optional[int], int]:
    """Shared sampling fields -> (SamplingParams without seed, seed, n); ``limits`` bounds n × prompts and stops."""
    max_tokens, name_used = None, max_tokens_names[0]
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens, name_used = _int(body, name, None, lo=1), name
            break
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"the prompt has {prompt_len} tokens; max_model_len={max_model_len} leaves no room for a completion",
            "prompt" if "prompt" in body else "messages",
        )
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise RequestError(
            f"'{name_used}'={max_tokens} plus the prompt's {prompt_len} tokens exceeds max_model_len={max_model_len}",
            name_used,
        )
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    check_sequences(n, num_prompts, limits)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError(
            f"'best_of'={best_of} is not supported: only best_of == n ({n}) is (every sample is returned)", "best_of"
        )
    seed = _int(body, "seed", None, lo=-(2**63), hi=2**64 - n)  # choice i uses seed + i: a 64-bit generator seed
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise RequestError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    stop = _stop(body)
    check_stop(stop, stop_token_ids, limits)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0),
        top_p=_float(body, "top_p", 1.0),
        seed=None,
        stop=stop,
        stop_token_ids=list(stop_token_ids),
        ignore_eos=_bool(body, "ignore_eos", False),
        top_k=_top_k(body),
        min_p=_float(body, "min_p", 0.0),
        presence_penalty=_float(body, "presence_penalty", 0.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0),
        logit_bias=_logit_bias(body, vocab_size),
        min_tokens=_int(body, "min_tokens", 0, lo=0),
        top_logprobs=top_logprobs,
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
    )
    return params, seed, n


def _validate(prompts: list[list[int]], params: SamplingParams, engine: Any) -> None:
    """The engine's own range checks, at parse time (so a streamed request fails before its first byte)."""
    for prompt in prompts:
        try:
            validate_request(prompt, params, engine.vocab_size, engine.max_model_len)
        except EngineError as e:
            head = str(e).split(":", 1)[0].split("[", 1)[0].strip()
            raise RequestError(str(e), {"prompt_token_ids": "prompt"}.get(head, head)) from None


def _as_dict(body: Any, endpoint: str) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    refused = refusal(body, endpoint)
    if refused is not None:
        raise RequestError(refused[1], refused[0])
    return body


# ---------------------------------------------------------------- /v1/completions


def parse_completion_request(
    body: Any,
    engine: Any,
    served_names: tuple[str, ...],
    limits: RequestLimits = DEFAULT_LIMITS,
    tool_parser: Optional[ToolParser] = None,
) -> ParsedRequest:
    """Validate a /v1/completions body against the engine's vocabulary and context length (and ``limits``)."""
    body = _as_dict(body, "completions")
    model = _check_model(body, served_names)
    if "prompt" not in body:
        raise RequestError("'prompt' is required", "prompt")
    raw = body["prompt"]
    if isinstance(raw, str) or (isinstance(raw, list) and raw and _is_int(raw[0])):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestError("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    if len(raw) > MAX_PROMPTS:
        raise RequestError(f"'prompt' holds {len(raw)} prompts; at most {MAX_PROMPTS} per request", "prompt")
    max_chars = MAX_CHARS_PER_TOKEN * engine.max_model_len
    add_special = _bool(body, "add_special_tokens", True)
    prompts: list[list[int]] = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise RequestError("'prompt' is an empty string", "prompt")
            if len(p) > max_chars:
                raise RequestError(
                    f"'prompt' has {len(p)} characters; it cannot fit max_model_len="
                    f"{engine.max_model_len} tokens (limit {max_chars} characters)",
                    "prompt",
                )
            ids = engine.tokenizer.encode(p, add_special_tokens=add_special)
            if not ids:
                raise RequestError("'prompt' tokenized to no tokens", "prompt")
            prompts.append(list(ids))
        else:
            prompts.append(_token_ids(p, engine.vocab_size, "prompt"))
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    stream = _bool(body, "stream", False)
    prompt_logprobs, score_only = _prompt_logprobs(body, prompts, stream, engine.max_model_len)
    params, seed, n = _sampling(
        {**body, "max_tokens": 1} if score_only else body,  # checks every other field; nothing is generated
        0 if score_only else max(len(p) for p in prompts),
        engine.max_model_len,
        engine.vocab_size,
        logprobs or 0,
        16,
        ("max_tokens",),
        len(prompts),
        limits,
    )
    tools = body.get("tools")
    _check_tools_size(tools if isinstance(tools, list) else None, engine.config)
    try:  # response_format, or tool_choice forcing a call of 'tools' (not rendered: the prompt is the caller's)
        params = replace(params, constraint=completion_constraint(body, tool_parser))
    except StructuredOutputError as e:
        raise RequestError(str(e), e.param) from None
    if score_only:
        params = replace(params, max_tokens=0)
    else:
        _validate(prompts, params, engine)
    return ParsedRequest(
        prompts=prompts,
        n=n,
        params=params,
        seed=seed,
        logprobs=logprobs,
        return_token_ids=_bool(body, "return_token_ids", False),
        model=model,
        stream=stream,
        include_usage=_stream_options(body, stream),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
        prompt_logprobs=prompt_logprobs,
    )


def _prompt_logprobs(
    body: dict, prompts: list[list[int]], stream: bool, max_model_len: int
) -> tuple[Optional[int], bool]:
    """``prompt_logprobs`` (k in 0..20, or None) and whether the request only scores (``max_tokens: 0``).

    vLLM refuses ``max_tokens: 0``; this server takes it with ``prompt_logprobs`` (a scoring request that
    generates nothing, so a prompt may then fill the whole context). Streaming is refused, as vLLM does."""
    k = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if k is None:
        return None, False
    if stream:
        raise RequestError("'prompt_logprobs' is not supported with 'stream': true", "prompt_logprobs")
    max_tokens = body.get("max_tokens")
    if not (_is_int(max_tokens) and max_tokens == 0):
        return k, False
    longest = max(len(p) for p in prompts)
    if longest > max_model_len:
        raise RequestError(f"the prompt has {longest} tokens, more than max_model_len={max_model_len}", "prompt")
    return k, True


# ---------------------------------------------------------------- /v1/chat/completions


def _check_tools_size(tools: Optional[list[dict]], config: Any) -> None:
    """400 naming ``tools`` when the list is longer than ``config.max_tools`` or its compact JSON longer than
    ``config.max_tools_bytes`` (``EngineConfig``)."""
    if not tools:
        return
    if len(tools) > config.max_tools:
        raise RequestError(f"'tools' has {len(tools)} entries; the limit is max_tools={config.max_tools}", "tools")
    size = len(json.dumps(tools, ensure_ascii=False, separators=(",", ":")).encode())
    if size > config.max_tools_bytes:
        raise RequestError(
            f"'tools' takes {size} bytes as JSON; the limit is max_tools_bytes={config.max_tools_bytes}", "tools"
        )


def parse_chat_request(
    body: Any,
    engine: Any,
    served_names: tuple[str, ...],
    limits: RequestLimits = DEFAULT_LIMITS,
    tool_parser: Optional[ToolParser] = None,
) -> ParsedRequest:
    """Validate a /v1/chat/completions body and render its messages with the chat template.

    ``chat_template_kwargs`` may set only the template's own variables (``request_limits``); the
    rendered text is measured before it is tokenized (as ``apply_chat_template(tokenize=True)``
    would: no special tokens added)."""
    body = _as_dict(body, "chat")
    model = _check_model(body, served_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    try:  # OpenAI-SDK histories (content None, arguments as JSON strings...) in the form templates render
        messages = prepare_for_template(messages, engine.tokenizer)
    except ChatMessageError as e:
        raise RequestError(f"'{e.path}': {e.detail}", "messages") from e
    max_chars = MAX_CHARS_PER_TOKEN * engine.max_model_len
    chars = len(json.dumps(messages, ensure_ascii=False))
    if chars > max_chars:
        raise RequestError(
            f"'messages' have {chars} characters; they cannot fit max_model_len={engine.max_model_len} "
            f"tokens (limit {max_chars} characters)",
            "messages",
        )
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of objects", "tools")
    _check_tools_size(tools, engine.config)
    try:  # tool_choice 'required' / a named tool, response_format json: the output's grammar
        parse_calls, constraint = chat_constraint(body, tools, tool_parser)
    except StructuredOutputError as e:
        raise RequestError(str(e), e.param) from None
    if body.get("prompt_logprobs") is not None:
        raise RequestError(
            "'prompt_logprobs' is served on /v1/completions only: send the rendered prompt's token ids there",
            "prompt_logprobs",
        )
    if body.get("parallel_tool_calls") is False:
        raise RequestError(
            "'parallel_tool_calls': false is not supported: this server does not limit a reply to one tool call",
            "parallel_tool_calls",
        )
    _bool(body, "parallel_tool_calls", True)
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    if template_kwargs.get("chat_template") is not None:
        raise RequestError(
            "'chat_template_kwargs.chat_template' is not supported: request-supplied chat templates "
            "are not rendered (the model's own template is used)",
            "chat_template_kwargs",
        )
    check_template_kwargs(template_kwargs, engine.tokenizer, tools or None)
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    continue_final = _bool(body, "continue_final_message", False)
    if continue_final and add_generation_prompt:
        raise RequestError(
            "'continue_final_message': true needs 'add_generation_prompt': false", "continue_final_message"
        )
    try:  # a template that ignores ``tools`` gets them in the system message (never silently dropped)
        rendering = tool_rendering(engine.tokenizer) if tools else None
        messages, tools_arg = messages_with_tools(engine.tokenizer, messages, tools)
        text = engine.tokenizer.apply_chat_template(
            messages,
            tools=tools_arg,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **template_kwargs,
        )
    except Exception as e:  # jinja errors name the template problem
        raise RequestError(f"the chat template could not render 'messages': {e}", "messages") from e
    if not isinstance(text, str):
        raise RequestError("the chat template did not render to text", "messages")
    if len(text) > max_chars:
        raise RequestError(
            f"the rendered prompt has {len(text)} characters; it cannot fit max_model_len={engine.max_model_len} "
            f"tokens (limit {max_chars} characters)",
            "chat_template_kwargs" if template_kwargs else "messages",
        )
    ids = engine.tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise RequestError("'messages' rendered to an empty prompt", "messages")
    prompt = _token_ids(list(ids), engine.vocab_size, "messages")
    wants_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not wants_logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream = _bool(body, "stream", False)
    params, seed, n = _sampling(
        body,
        len(prompt),
        engine.max_model_len,
        engine.vocab_size,
        (top or 0) if wants_logprobs else 0,
        None,
        ("max_completion_tokens", "max_tokens"),
        1,
        limits,
    )
    params = replace(params, constraint=constraint)
    _validate([prompt], params, engine)
    return ParsedRequest(
        prompts=[prompt],
        n=n,
        params=params,
        seed=seed,
        logprobs=(top or 0) if wants_logprobs else None,
        return_token_ids=_bool(body, "return_token_ids", False),
        model=model,
        tools=tools or None,
        tool_rendering=rendering,
        parse_tool_calls=parse_calls,
        tool_parser=tool_parser,
        stream=stream,
        include_usage=_stream_options(body, stream),
        tokens_as_ids=_bool(body, "return_tokens_as_token_ids", False),
    )
