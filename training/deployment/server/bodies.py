"""Whole (non-streamed) OpenAI responses, and the pieces the streamed chunks share with them.

Building turns the engine's ``GenerationResult`` objects into OpenAI / vLLM-shaped JSON, with
the extras an RL trainer needs: per-choice ``token_ids`` / ``token_weight_versions`` / ``prompt_token_ids``
(``return_token_ids``), the sampled tokens' logprobs and the k most likely alternatives,
``stop_reason``, ``usage.prompt_tokens_details.cached_tokens`` and a ``weight_version`` at the
top level and on every choice. A completions request with ``prompt_logprobs`` gets vLLM's
``choices[].prompt_logprobs`` (``prompt_logprobs_entries``). A chat request with ``tools`` also gets a top-level ``tool_rendering``
(``template`` or ``system_prompt``: how the schemas reached the prompt, see ``protocol.py``).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from training.deployment.engine.requests import GenerationResult
from training.deployment.engine.runners.scoring import PromptLogprobs
from training.deployment.server.protocol import ParsedRequest
from training.openai_api.tool_parsers import HermesToolParser, ToolParser, to_openai_tool_calls


def token_text(tokenizer: Any, token_id: int, as_ids: bool = False) -> str:
    """The string a logprobs entry shows for a token (``token_id:N`` with ``return_tokens_as_token_ids``)."""
    return f"token_id:{token_id}" if as_ids else tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any,
    req: ParsedRequest,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: Optional[list[list[tuple[int, float]]]],
    offset: int = 0,
) -> dict:
    """Completions ``logprobs`` for these tokens; ``text_offset`` counts from ``offset``.

    With ``logprobs = k > 0`` each ``top_logprobs`` entry maps the k most likely tokens' strings to
    their logprobs, plus the sampled token (so up to k + 1 entries, as OpenAI); two token ids that
    decode to the same string share a key (use ``return_tokens_as_token_ids`` to keep them apart).
    """
    tokens = [token_text(tokenizer, t, req.tokens_as_ids) for t in token_ids]
    offsets = []
    for s in tokens:
        offsets.append(offset)
        offset += len(s)
    top = None
    if req.logprobs:
        top = []
        for s, lp, alts in zip(tokens, logprobs, top_logprobs or [[]] * len(tokens)):
            entry = {token_text(tokenizer, t, req.tokens_as_ids): v for t, v in alts}
            entry.setdefault(s, lp)
            top.append(entry)
    return {"tokens": tokens, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(
    tokenizer: Any,
    req: ParsedRequest,
    token_ids: list[int],
    logprobs: list[float],
    top_logprobs: Optional[list[list[tuple[int, float]]]],
) -> dict:
    """Chat ``logprobs.content`` for these tokens, each with its k most likely alternatives."""

    def entry(t: int, lp: float) -> dict:
        s = token_text(tokenizer, t, req.tokens_as_ids)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    content = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        alts = top_logprobs[i] if top_logprobs else []
        content.append({**entry(t, lp), "top_logprobs": [entry(a, v) for a, v in alts]})
    return {"content": content}


def prompt_logprobs_entries(tokenizer: Any, scored: PromptLogprobs, as_ids: bool = False) -> list[Optional[dict]]:
    """vLLM's ``prompt_logprobs`` of one prompt: None for the first token, then per token a dict keyed by token id
    (a string in JSON) of ``{"logprob", "rank", "decoded_token"}``: the prompt's own token first, then the
    k likeliest tokens (k + 1 entries, or k when the prompt's token is among them)."""
    out: list[Optional[dict]] = []
    tops = scored.top_logprobs or [None] * len(scored.token_ids)
    for t, (token, lp, rank, top) in enumerate(zip(scored.token_ids, scored.logprobs, scored.ranks, tops)):
        if t == 0 or lp is None:
            out.append(None)
            continue
        entry = {str(token): {"logprob": lp, "rank": rank, "decoded_token": token_text(tokenizer, token, as_ids)}}
        for r, (alt, alt_lp) in enumerate(top or [], 1):
            entry.setdefault(
                str(alt), {"logprob": alt_lp, "rank": r, "decoded_token": token_text(tokenizer, alt, as_ids)}
            )
        out.append(entry)
    return out


def usage(req: ParsedRequest, results: list[list[GenerationResult]]) -> dict:
    """OpenAI ``usage`` over every choice; ``cached_tokens`` counts each prompt once (its fewest)."""
    prompt_tokens = sum(len(p) for p in req.prompts)
    completion_tokens = sum(len(r.output_token_ids) for rs in results for r in rs)
    # a prompt is computed once for all its choices (the others reuse it): what that computation reused
    cached = sum(min((r.cached_prompt_tokens for r in rs), default=0) for rs in results)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_version(results: list[list[GenerationResult]]) -> int:
    """Top-level weight version: the oldest version among the choices."""
    return min(r.weight_version for rs in results for r in rs)


def build_completion_response(
    req: ParsedRequest,
    results: list[list[GenerationResult]],
    tokenizer: Any,
    scored: Optional[list[PromptLogprobs]] = None,
) -> dict:
    """OpenAI ``text_completion`` JSON; ``results[p][i]`` is choice ``i`` of prompt ``p``; ``scored[p]``: the
    prompt logprobs of prompt ``p`` (``req.prompt_logprobs``), on each of its choices."""
    choices = []
    for p, rs in enumerate(results):
        prompt_entries = None if scored is None else prompt_logprobs_entries(tokenizer, scored[p], req.tokens_as_ids)
        for i, r in enumerate(rs):
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(
                    tokenizer, req, r.output_token_ids, r.output_logprobs, r.output_top_logprobs
                )
            choice = {
                "index": p * req.n + i,
                "text": r.text,
                "logprobs": logprobs,
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
                "weight_version": r.weight_version,
            }
            if req.return_token_ids:
                choice["token_ids"] = list(r.output_token_ids)
                choice["token_weight_versions"] = list(r.token_weight_versions)
                choice["prompt_token_ids"] = list(r.prompt_token_ids)
            if prompt_entries is not None:
                choice["prompt_logprobs"] = prompt_entries
            choices.append(choice)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(req, results),
        "weight_version": response_version(results),
    }


def parse_tool_calls(
    text: str, parser: Optional[ToolParser] = None, tools: Optional[list[dict]] = None
) -> tuple[str, list[dict]]:
    """Split the tool calls of ``parser``'s format (Hermes ``<tool_call>`` blocks by default) out of ``text``.

    Returns (content, OpenAI ``tool_calls``). The content is the text outside the calls; if any call was
    malformed, it is the whole reply, so nothing the model wrote is hidden from the client. Call ids are unique
    per response (``parser.call_id``: Mistral's are 9 alphanumerics, as its templates require). ``tools`` type
    the values of untyped formats (Qwen3-Coder XML).
    """
    parser = parser or HermesToolParser()
    parsed = parser.parse(text, id_prefix=f"call_{uuid.uuid4().hex[:16]}_", tools=tools)
    if not parsed.calls:
        return text, []
    return (text if parsed.errors else parsed.content), to_openai_tool_calls(parsed.calls)


def chat_finish_reason(result: GenerationResult, has_calls: bool) -> str:
    """``tool_calls`` when the reply made tool calls and was not cut at ``length``."""
    return "tool_calls" if has_calls and result.finish_reason != "length" else result.finish_reason


def build_chat_response(req: ParsedRequest, results: list[GenerationResult], tokenizer: Any) -> dict:
    """OpenAI ``chat.completion`` JSON; tool calls parsed when the request gave ``tools``."""
    choices = []
    for i, r in enumerate(results):
        content, calls = parse_tool_calls(r.text, req.tool_parser, req.tools) if req.parse_tool_calls else (r.text, [])
        message = {"role": "assistant", "content": content if (content or not calls) else None, "tool_calls": calls}
        logprobs = None
        if req.logprobs is not None:
            logprobs = chat_logprobs(tokenizer, req, r.output_token_ids, r.output_logprobs, r.output_top_logprobs)
        choice = {
            "index": i,
            "message": message,
            "logprobs": logprobs,
            "finish_reason": chat_finish_reason(r, bool(calls)),
            "stop_reason": r.stop_reason,
            "weight_version": r.weight_version,
        }
        if req.return_token_ids:
            choice["token_ids"] = list(r.output_token_ids)
            choice["token_weight_versions"] = list(r.token_weight_versions)
            choice["prompt_token_ids"] = list(r.prompt_token_ids)
        choices.append(choice)
    out = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": choices,
        "usage": usage(req, [results]),
        "weight_version": response_version([results]),
    }
    if req.tool_rendering is not None:
        out["tool_rendering"] = req.tool_rendering
    if req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompts[0])
    return out
