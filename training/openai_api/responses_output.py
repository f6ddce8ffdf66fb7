"""Chat-completion replies -> OpenAI Responses API objects, and the conversation a response leaves behind.

A chat reply (one choice) becomes the response's ``output`` items, in this order: a ``message`` item with
one ``output_text`` part (the reply's ``content``; present when there is text, or no call), then one
``function_call`` item per tool call (``call_id``: the chat call's id, ``name``, ``arguments`` as a JSON
string). Item ids are derived from the response id (``msg_<hex>``, ``fc_<hex>_<i>``). A reply cut at
``length`` gives ``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``.

``usage``: ``input_tokens`` (with ``input_tokens_details.cached_tokens``), ``output_tokens`` (with
``output_tokens_details.reasoning_tokens`` 0), ``total_tokens``.

RL extras (beside the OpenAI fields, as on chat completions): ``weight_version`` always (the oldest
weight version among the output tokens; ``tool_rendering`` too when the request had tools); with
``return_token_ids: true``, ``prompt_token_ids`` (the exact prompt: instructions, the previous response's
conversation and ``input`` rendered by the chat template), ``token_ids`` (every output token: text and
tool-call blocks alike, in order) and ``token_weight_versions`` (parallel to ``token_ids``); with
``include: ["message.output_text.logprobs"]`` (or ``top_logprobs``), ``logprobs.content``: one entry per
output token, parallel to ``token_ids`` (``{"token", "logprob", "bytes", "top_logprobs"}``, the chat
form; under constrained decoding the logprob of the masked distribution that drew the token). The
``output_text`` part carries the same entries as its ``logprobs`` when the message is the whole output
(no function call); when the reply also called tools its text is not a run of whole tokens, so the part's
``logprobs`` is ``[]`` and the top-level list is the exact one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Optional

from training.openai_api.responses_request import ResponsesRequest


def new_response_id() -> str:
    """``resp_<32 hex>``."""
    return f"resp_{uuid.uuid4().hex}"


def message_item_id(response_id: str, n: int = 0) -> str:
    """Id of the ``n``-th message item of a response."""
    return f"msg_{response_id.removeprefix('resp_')}" + (f"_{n}" if n else "")


def call_item_id(response_id: str, i: int) -> str:
    """Id of the ``i``-th function_call item of a response."""
    return f"fc_{response_id.removeprefix('resp_')}_{i}"


def text_part(text: str, logprobs: Optional[list] = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": list(logprobs or [])}


def message_item(item_id: str, text: str, status: str, logprobs: Optional[list] = None) -> dict:
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": [text_part(text, logprobs)] if status != "in_progress" else [],
    }


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict:
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
    }


def finish_status(reply: dict) -> str:
    """``incomplete`` when the reply was cut at ``length``, else ``completed``."""
    return "incomplete" if reply["choices"][0].get("finish_reason") == "length" else "completed"


def output_items(reply: dict, response_id: str, with_logprobs: bool = False) -> list[dict]:
    """The ``output`` of a chat reply: a message item (text, or no call), then one item per tool call."""
    choice = reply["choices"][0]
    msg = choice.get("message") or {}
    calls = msg.get("tool_calls") or []
    status = finish_status(reply)
    items = []
    if msg.get("content") or not calls:
        entries = ((choice.get("logprobs") or {}).get("content") or []) if with_logprobs and not calls else []
        items.append(message_item(message_item_id(response_id), msg.get("content") or "", status, entries))
    for i, c in enumerate(calls):
        fn = c.get("function") or {}
        items.append(
            call_item(
                call_item_id(response_id, i), c.get("id") or "", fn.get("name", ""), fn.get("arguments") or "", status
            )
        )
    return items


def usage_of(reply: dict) -> Optional[dict]:
    """Chat ``usage`` -> Responses ``usage``."""
    u = reply.get("usage")
    if not u:
        return None
    cached = int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return {
        "input_tokens": int(u.get("prompt_tokens", 0)),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": int(u.get("completion_tokens", 0)),
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": int(u.get("total_tokens", 0)),
    }


def response_object(
    rr: ResponsesRequest,
    response_id: str,
    created_at: Optional[int] = None,
    *,
    model: str = "",
    status: str = "in_progress",
    output: Optional[list[dict]] = None,
    reply: Optional[dict] = None,
) -> dict:
    """The Responses ``response`` object; with ``reply`` (the chat reply it answers) its usage and RL extras."""
    out: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": rr.instructions,
        "max_output_tokens": rr.max_output_tokens,
        "model": model,
        "output": list(output or []),
        "parallel_tool_calls": rr.parallel_tool_calls,
        "previous_response_id": rr.previous_response_id,
        "reasoning": {"effort": None, "summary": None},
        "store": rr.store,
        "temperature": 1.0 if rr.temperature is None else rr.temperature,
        "text": rr.text,
        "tool_choice": rr.tool_choice,
        "tools": rr.tools,
        "top_p": 1.0 if rr.top_p is None else rr.top_p,
        "top_logprobs": rr.top_logprobs,
        "truncation": "disabled",
        "usage": None,
        "user": rr.user,
        "metadata": rr.metadata,
        "background": False,
    }
    if reply is not None:
        out["usage"] = usage_of(reply)
        out.update(rl_extras(rr, reply))
    return out


def rl_extras(rr: ResponsesRequest, reply: dict) -> dict:
    """``weight_version`` (and ``tool_rendering``), plus the token ids / logprobs the request asked for."""
    choice = reply["choices"][0]
    out: dict[str, Any] = {}
    version = choice.get("weight_version", reply.get("weight_version"))
    if version is not None:
        out["weight_version"] = version
    if reply.get("tool_rendering") is not None:
        out["tool_rendering"] = reply["tool_rendering"]
    if rr.return_token_ids:
        out["prompt_token_ids"] = list(choice.get("prompt_token_ids") or reply.get("prompt_token_ids") or [])
        out["token_ids"] = list(choice.get("token_ids") or [])
        if choice.get("token_weight_versions") is not None:
            out["token_weight_versions"] = list(choice["token_weight_versions"])
    if rr.logprobs:
        out["logprobs"] = {"content": list((choice.get("logprobs") or {}).get("content") or [])}
    return out


def completed_response(rr: ResponsesRequest, reply: dict, response_id: str, created_at: int, model: str) -> dict:
    """The finished response to a (non-streamed) chat reply."""
    items = output_items(reply, response_id, with_logprobs=rr.logprobs)
    return response_object(
        rr, response_id, created_at, model=model, status=finish_status(reply), output=items, reply=reply
    )


def assistant_message(items: list[dict]) -> dict:
    """The chat assistant message a response's ``output`` items stand for (text joined, calls in order)."""
    text = "".join(p.get("text", "") for it in items if it["type"] == "message" for p in it.get("content") or [])
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in items
        if it["type"] == "function_call"
    ]
    if calls:
        msg["tool_calls"] = calls
    return msg


def conversation_after(rr: ResponsesRequest, history: list[dict], response: dict) -> list[dict]:
    """What ``previous_response_id`` continues: the earlier conversation, this input, this output
    (instructions excluded, as OpenAI: each request gives its own)."""
    return list(history) + list(rr.input_messages) + [assistant_message(response["output"])]
