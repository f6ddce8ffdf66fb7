"""OpenAI-compatible request parsing and response building for the deployment server.

Parsing turns a JSON body into a ``ParsedRequest`` (token-id prompts + ``SamplingParams``)
or raises ``RequestError`` naming the offending field; the server answers that with
400 ``{"error": {"message", "type": "invalid_request_error", "param"}}``. Building turns the
engine's ``GenerationResult`` objects back into OpenAI / vLLM-shaped JSON, with the extras an
RL trainer needs: per-choice ``token_ids`` / ``prompt_token_ids`` / ``token_weight_versions``
(``return_token_ids``),
the sampled tokens' logprobs, ``usage.prompt_tokens_details.cached_tokens`` and a
``weight_version`` at the top level and on every choice.

Unknown fields are ignored (clients send many optional OpenAI fields); known fields are
type-checked. ``stream`` and ``echo`` are refused (not implemented).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from training.deployment.engine.config import GenerationResult, SamplingParams
from training.utils.tool_parsers import HermesToolParser, to_openai_tool_calls

MAX_N = 256
"""Upper bound on ``n`` (choices per prompt) in one request."""
MAX_TOP_LOGPROBS = 20
"""Upper bound on ``logprobs`` (completions) / ``top_logprobs`` (chat), as OpenAI."""
SESSION_HEADER = "x-multi-turn-session-id"
"""Request header whose value becomes the engine ``session_id`` (KV reuse across turns)."""



class RequestError(Exception):
    """A client error: ``status`` (400 unless told), the problem, the offending field."""

    def __init__(self, message: str, param: Optional[str] = None, *, status: int = 400,
                 err_type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type


def error_body(message: str, err_type: str = "invalid_request_error", param: Optional[str] = None) -> dict:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": None}}


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
    """None = no logprobs in the response; k >= 0 = sampled-token logprobs (+ k top entries, see README)."""
    return_token_ids: bool
    """Add ``token_ids`` and ``prompt_token_ids`` to every choice."""
    model: str
    """The model name echoed in the response."""
    tools: Optional[list[dict]] = None
    """Chat only: the tool schemas; when given, ``<tool_call>`` blocks become ``message.tool_calls``."""
    extra: dict[str, Any] = field(default_factory=dict)

    def params_for(self, choice_index: int) -> SamplingParams:
        """Sampling params of choice ``choice_index`` (seed + index when a seed was given)."""
        seed = None if self.seed is None else self.seed + choice_index
        return replace(self.params, seed=seed)


# ---------------------------------------------------------------- field readers

def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _int(body: dict, name: str, default: Optional[int], lo: Optional[int] = None,
         hi: Optional[int] = None) -> Optional[int]:
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
    if not _is_number(v):
        raise RequestError(f"'{name}' must be a number, got {type(v).__name__} {v!r}", name)
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
        raise RequestError(f"The model '{model}' does not exist; this server serves '{served_names[0]}'",
                           "model", status=404, err_type="NotFoundError")
    return served_names[0]


def _sampling(body: dict, prompt_len: int, max_model_len: int, default_max_tokens: Optional[int],
              max_tokens_names: tuple[str, ...]) -> tuple[SamplingParams, Optional[int], int]:
    """Shared sampling fields -> (SamplingParams without seed, seed, n)."""
    for name in ("stream", "echo"):
        if body.get(name):
            raise RequestError(f"'{name}' is not supported by this server", name)
    max_tokens, name_used = None, max_tokens_names[0]
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens, name_used = _int(body, name, None, lo=1), name
            break
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(f"the prompt has {prompt_len} tokens; max_model_len={max_model_len} leaves no room "
                           "for a completion", "prompt" if "prompt" in body else "messages")
    if max_tokens is None:
        max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
    elif max_tokens > room:
        raise RequestError(f"'{name_used}'={max_tokens} plus the prompt's {prompt_len} tokens exceeds "
                           f"max_model_len={max_model_len}", name_used)
    temperature = _float(body, "temperature", 1.0)
    if temperature < 0:
        raise RequestError(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _float(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    n = _int(body, "n", 1, lo=1, hi=MAX_N)
    seed = _int(body, "seed", None)
    stop_token_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_token_ids, list) or not all(_is_int(t) for t in stop_token_ids):
        raise RequestError("'stop_token_ids' must be a list of integers", "stop_token_ids")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=None,
                            stop=_stop(body), stop_token_ids=list(stop_token_ids),
                            ignore_eos=_bool(body, "ignore_eos", False))
    return params, seed, n


def _as_dict(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---------------------------------------------------------------- /v1/completions

def parse_completion_request(body: Any, engine: Any, served_names: tuple[str, ...]) -> ParsedRequest:
    """Validate a /v1/completions body against the engine's vocabulary and context length."""
    body = _as_dict(body)
    model = _check_model(body, served_names)
    if "prompt" not in body:
        raise RequestError("'prompt' is required", "prompt")
    raw = body["prompt"]
    if isinstance(raw, str) or (isinstance(raw, list) and raw and _is_int(raw[0])):
        raw = [raw]
    if not isinstance(raw, list) or not raw:
        raise RequestError("'prompt' must be a non-empty string, a list of token ids, or a list of those", "prompt")
    prompts: list[list[int]] = []
    for p in raw:
        if isinstance(p, str):
            if not p:
                raise RequestError("'prompt' is an empty string", "prompt")
            ids = engine.tokenizer.encode(p, add_special_tokens=True)
            if not ids:
                raise RequestError("'prompt' tokenized to no tokens", "prompt")
            prompts.append(list(ids))
        else:
            prompts.append(_token_ids(p, engine.vocab_size, "prompt"))
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    params, seed, n = _sampling(body, max(len(p) for p in prompts), engine.max_model_len, 16, ("max_tokens",))
    return ParsedRequest(prompts=prompts, n=n, params=params, seed=seed, logprobs=logprobs,
                         return_token_ids=_bool(body, "return_token_ids", False), model=model)


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def _completion_logprobs(tokenizer: Any, r: GenerationResult, k: int) -> dict:
    tokens = [_token_text(tokenizer, t) for t in r.output_token_ids]
    offsets, pos = [], 0
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = [{s: lp} for s, lp in zip(tokens, r.output_logprobs)] if k > 0 else None
    return {"tokens": tokens, "token_logprobs": list(r.output_logprobs), "top_logprobs": top, "text_offset": offsets}


def _usage(req: ParsedRequest, results: list[list[GenerationResult]]) -> dict:
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(len(r.output_token_ids) for rs in results for r in rs)
    # a prompt is counted once however many choices share it: cached = what its first computation reused
    cached = sum(min((r.cached_prompt_tokens for r in rs), default=0) for rs in results)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _response_version(results: list[list[GenerationResult]]) -> int:
    """Top-level weight version: the oldest version among the choices."""
    return min(r.weight_version for rs in results for r in rs)


def build_completion_response(req: ParsedRequest, results: list[list[GenerationResult]], tokenizer: Any) -> dict:
    """OpenAI ``text_completion`` JSON; ``results[p][i]`` is choice ``i`` of prompt ``p``."""
    choices = []
    for p, rs in enumerate(results):
        for i, r in enumerate(rs):
            choice = {"index": p * req.n + i, "text": r.text,
                      "logprobs": None if req.logprobs is None else _completion_logprobs(tokenizer, r, req.logprobs),
                      "finish_reason": r.finish_reason, "stop_reason": None, "weight_version": r.weight_version}
            if req.return_token_ids:
                choice["token_ids"] = list(r.output_token_ids)
                choice["prompt_token_ids"] = list(r.prompt_token_ids)
                choice["token_weight_versions"] = list(r.token_weight_versions)
            choices.append(choice)
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": req.model, "choices": choices, "usage": _usage(req, results),
            "weight_version": _response_version(results)}


# ---------------------------------------------------------------- /v1/chat/completions

def _normalise_message(i: int, m: Any) -> dict:
    if not isinstance(m, dict):
        raise RequestError(f"'messages'[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "developer", "user", "assistant", "tool"):
        raise RequestError(f"'messages'[{i}].role={role!r} is not one of system, developer, user, assistant, tool",
                           "messages")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise RequestError(f"'messages'[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        out["content"] = "".join(texts)
    elif content is None:
        if role != "assistant":
            raise RequestError(f"'messages'[{i}].content is required for role {role!r}", "messages")
    elif not isinstance(content, str):
        raise RequestError(f"'messages'[{i}].content must be a string or a list of text parts", "messages")
    return out


def parse_chat_request(body: Any, engine: Any, served_names: tuple[str, ...]) -> ParsedRequest:
    """Validate a /v1/chat/completions body and render its messages with the chat template."""
    body = _as_dict(body)
    model = _check_model(body, served_names)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list", "messages")
    messages = [_normalise_message(i, m) for i, m in enumerate(messages)]
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise RequestError("'tools' must be a list of objects", "tools")
    template_kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(template_kwargs, dict):
        raise RequestError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    try:
        ids = engine.tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=True,
                                                   tokenize=True, return_dict=False, **template_kwargs)
    except Exception as e:  # jinja errors name the template problem
        raise RequestError(f"the chat template could not render 'messages': {e}", "messages") from e
    if not ids:
        raise RequestError("'messages' rendered to an empty prompt", "messages")
    prompt = _token_ids(list(ids), engine.vocab_size, "messages")
    wants_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top is not None and not wants_logprobs:
        raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    params, seed, n = _sampling(body, len(prompt), engine.max_model_len, None,
                                ("max_completion_tokens", "max_tokens"))
    return ParsedRequest(prompts=[prompt], n=n, params=params, seed=seed,
                         logprobs=(top or 0) if wants_logprobs else None,
                         return_token_ids=_bool(body, "return_token_ids", False), model=model,
                         tools=tools or None)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """Split Qwen/Hermes ``<tool_call>{"name", "arguments"}</tool_call>`` blocks out of ``text``.

    Returns (content, OpenAI ``tool_calls``), parsed by ``HermesToolParser``. The
    content is the text outside the blocks; if any block was malformed, it is the whole reply,
    so nothing the model wrote is hidden from the client. Call ids are unique per response.
    """
    parsed = HermesToolParser().parse(text, id_prefix=f"call_{uuid.uuid4().hex[:16]}_")
    if not parsed.calls:
        return text, []
    return (text if parsed.errors else parsed.content), to_openai_tool_calls(parsed.calls)


def _chat_logprobs(tokenizer: Any, r: GenerationResult, k: int) -> dict:
    content = []
    for t, lp in zip(r.output_token_ids, r.output_logprobs):
        s = _token_text(tokenizer, t)
        entry = {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
        if k > 0:
            entry["top_logprobs"] = [{"token": s, "logprob": lp, "bytes": entry["bytes"]}]
        content.append(entry)
    return {"content": content}


def build_chat_response(req: ParsedRequest, results: list[GenerationResult], tokenizer: Any) -> dict:
    """OpenAI ``chat.completion`` JSON with tool calls parsed when the request gave ``tools``."""
    choices = []
    for i, r in enumerate(results):
        content, calls = parse_tool_calls(r.text) if req.tools else (r.text, [])
        finish = r.finish_reason
        if calls and finish != "length":
            finish = "tool_calls"
        message = {"role": "assistant", "content": content if (content or not calls) else None, "tool_calls": calls}
        choice = {"index": i, "message": message,
                  "logprobs": None if req.logprobs is None else _chat_logprobs(tokenizer, r, req.logprobs),
                  "finish_reason": finish, "stop_reason": None, "weight_version": r.weight_version}
        if req.return_token_ids:
            choice["token_ids"] = list(r.output_token_ids)
            choice["prompt_token_ids"] = list(r.prompt_token_ids)
            choice["token_weight_versions"] = list(r.token_weight_versions)
        choices.append(choice)
    out = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
           "model": req.model, "choices": choices, "usage": _usage(req, [results]),
           "weight_version": _response_version([results])}
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompts[0])
    return out
