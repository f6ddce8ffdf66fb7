"""Server-sent events through the proxy: exact recording whatever the upstream does.

An agent that asks for ``stream: true`` gets OpenAI SSE (``data: {chunk}\\n\\n`` ... ``data: [DONE]``).
The proxy serves it in one of two ways (``ProxyServer(upstream_stream=...)``):

- **synthesised** (an upstream that does not stream, or ``upstream_stream="off"``): the call is
  forwarded without streaming, recorded from the full reply, and the reply is cut into chunks
  (``chat_chunks`` / ``completion_chunks``): a role chunk, the content, the tool calls, the
  finish reason, the usage when ``stream_options.include_usage``. The agent sees the reply when
  generation ends.
- **relayed** (``upstream_stream="on"``, or ``"auto"`` until an upstream refuses ``stream`` with
  a 400 naming it): the upstream streams with ``return_token_ids`` and logprobs on, each chunk
  goes to the agent as it arrives (token fields stripped unless asked for), and
  ``StreamAccumulator`` folds the chunks into the same body a non-streamed reply has (vLLM's
  chunk format: ``choices[].token_ids`` per chunk, ``prompt_token_ids`` on the first, the
  chunk's logprobs), which is recorded exactly like one.

Either way the recorded prompt ids, output ids and logprobs are the upstream's, never text. The
events are written and read with ``training/openai_api/sse.py`` (the server's framing too).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from aiohttp import web


class ClientStalled(Exception):
    """The agent did not take a streamed write within ``stream_write_timeout_s``: its connection was aborted
    (``ProxyServer.write``); the route returns ``resp``, the response it had started."""

    def __init__(self, resp: web.StreamResponse):
        super().__init__("the agent stopped reading the stream")
        self.resp = resp


@dataclass
class WantedFields:
    """What the agent asked to see beyond a plain OpenAI reply."""

    ids: bool
    """``return_token_ids``: keep ``token_ids`` / ``prompt_token_ids``."""
    logprobs: bool
    """Chat ``logprobs: true``, or completions ``logprobs`` set."""
    usage: bool
    """``stream_options.include_usage``: send the usage chunk."""
    model: Optional[str]
    """The agent's ``model`` name, echoed back."""


def wanted_fields(body: dict, endpoint: str) -> WantedFields:
    """The ``WantedFields`` of request ``body``."""
    return WantedFields(
        ids=bool(body.get("return_token_ids")),
        logprobs=bool(body.get("logprobs")) if endpoint == "chat" else body.get("logprobs") is not None,
        usage=bool((body.get("stream_options") or {}).get("include_usage")),
        model=body.get("model") if isinstance(body.get("model"), str) else None,
    )


def client_body(out: dict, body: dict, endpoint: str) -> dict:
    """A full upstream reply as the agent asked for it: token fields and logprobs only on request."""
    wants = wanted_fields(body, endpoint)
    out = copy.deepcopy(out)
    if not wants.ids:
        out.pop("prompt_token_ids", None)
    for choice in out.get("choices", []):
        if not wants.ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not wants.logprobs:
            choice["logprobs"] = None
        msg = choice.get("message")
        if isinstance(msg, dict) and not msg.get("tool_calls"):
            msg.pop("tool_calls", None)
    if wants.model is not None:
        out["model"] = wants.model
    return out


# ---------------------------------------------------------------- full reply -> chunks


def _chunk_base(reply: dict, obj: str) -> dict:
    return {
        "id": reply.get("id", ""),
        "object": obj,
        "created": reply.get("created", 0),
        "model": reply.get("model", ""),
    }


def chat_chunks(reply: dict, include_usage: bool) -> list[dict]:
    """The chunks of a finished ``chat.completion`` (already shaped for the client)."""
    base = _chunk_base(reply, "chat.completion.chunk")
    extra = {k: reply[k] for k in ("weight_version",) if k in reply}
    chunks = []
    for choice in reply.get("choices", []):
        i, msg = choice.get("index", 0), choice.get("message") or {}
        token_fields = {k: choice[k] for k in ("token_ids", "prompt_token_ids") if k in choice}
        first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        chunks.append({**base, **extra, "choices": [first]})
        body = {"index": i, "delta": {}, "logprobs": choice.get("logprobs"), "finish_reason": None, **token_fields}
        if msg.get("content"):
            body["delta"]["content"] = msg["content"]
        if msg.get("tool_calls"):
            body["delta"]["tool_calls"] = [{"index": j, **c} for j, c in enumerate(msg["tool_calls"])]
        if msg.get("reasoning_content"):
            body["delta"]["reasoning_content"] = msg["reasoning_content"]
        chunks.append({**base, **extra, "choices": [body]})
        last = {"index": i, "delta": {}, "logprobs": None, "finish_reason": choice.get("finish_reason")}
        chunks.append({**base, **extra, "choices": [last]})
    if include_usage and reply.get("usage") is not None:
        chunks.append({**base, "choices": [], "usage": reply["usage"]})
    return chunks


def completion_chunks(reply: dict, include_usage: bool) -> list[dict]:
    """The chunks of a finished ``text_completion`` (already shaped for the client)."""
    base = _chunk_base(reply, "text_completion")
    chunks = []
    for choice in reply.get("choices", []):
        body = {k: v for k, v in choice.items() if k != "finish_reason"}
        chunks.append({**base, "choices": [{**body, "finish_reason": None}]})
        chunks.append(
            {
                **base,
                "choices": [
                    {
                        "index": choice.get("index", 0),
                        "text": "",
                        "logprobs": None,
                        "finish_reason": choice.get("finish_reason"),
                    }
                ],
            }
        )
    if include_usage and reply.get("usage") is not None:
        chunks.append({**base, "choices": [], "usage": reply["usage"]})
    return chunks


# ---------------------------------------------------------------- upstream chunks -> one reply


class StreamAccumulator:
    """Folds streamed chunks (one choice) into the body a non-streamed reply would have."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.head: dict = {}
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, dict] = {}
        self.token_ids: list[int] = []
        self.prompt_token_ids: Optional[list[int]] = None
        self.chat_logprobs: list[dict] = []
        self.token_logprobs: list[float] = []
        self.tokens: list[str] = []
        self.finish_reason: Optional[str] = None
        self.weight_version: Optional[int] = None
        self.usage: Optional[dict] = None

    def add(self, chunk: dict) -> None:
        if not self.head:
            self.head = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        if chunk.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(chunk["prompt_token_ids"])
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        if chunk.get("weight_version") is not None:
            self.weight_version = int(chunk["weight_version"])
        for choice in chunk.get("choices") or []:
            if choice.get("index", 0) != 0:
                raise ValueError("streamed choice index != 0 (the proxy asks for n = 1)")
            self._add_choice(choice)

    def _add_choice(self, choice: dict) -> None:
        if choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = list(choice["prompt_token_ids"])
        self.token_ids += list(choice.get("token_ids") or [])
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        if choice.get("weight_version") is not None:
            self.weight_version = int(choice["weight_version"])
        lp = choice.get("logprobs") or {}
        if self.endpoint == "chat":
            self.chat_logprobs += lp.get("content") or []
            delta = choice.get("delta") or {}
            self.text.append(delta.get("content") or "")
            self.reasoning.append(delta.get("reasoning_content") or "")
            for tc in delta.get("tool_calls") or []:
                slot = self.tool_calls.setdefault(
                    tc.get("index", len(self.tool_calls)),
                    {"id": None, "type": "function", "function": {"name": "", "arguments": ""}},
                )
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["function"]["name"] += fn.get("name") or ""
                slot["function"]["arguments"] += fn.get("arguments") or ""
        else:
            self.text.append(choice.get("text") or "")
            self.token_logprobs += lp.get("token_logprobs") or []
            self.tokens += lp.get("tokens") or []

    def reply(self) -> dict:
        """The accumulated reply: ``choices[0]`` with ``token_ids``, ``prompt_token_ids``, logprobs, finish reason."""
        choice: dict[str, Any] = {"index": 0, "finish_reason": self.finish_reason, "token_ids": self.token_ids}
        if self.prompt_token_ids is not None:
            choice["prompt_token_ids"] = self.prompt_token_ids
        if self.weight_version is not None:
            choice["weight_version"] = self.weight_version
        text = "".join(self.text)
        if self.endpoint == "chat":
            calls = [self.tool_calls[k] for k in sorted(self.tool_calls)]
            message: dict[str, Any] = {
                "role": "assistant",
                "content": text if (text or not calls) else None,
                "tool_calls": calls,
            }
            if "".join(self.reasoning):
                message["reasoning_content"] = "".join(self.reasoning)
            choice.update(message=message, logprobs={"content": self.chat_logprobs})
            obj = "chat.completion"
        else:
            choice.update(text=text, logprobs={"token_logprobs": self.token_logprobs, "tokens": self.tokens})
            obj = "text_completion"
        out = {**self.head, "object": obj, "choices": [choice], "usage": self.usage}
        if self.weight_version is not None:
            out["weight_version"] = self.weight_version
        return out


def client_chunk(chunk: dict, wants: WantedFields) -> Optional[dict]:
    """An upstream chunk as the agent asked for it (None: nothing to send, e.g. a usage chunk it did not ask for)."""
    out = copy.deepcopy(chunk)
    if not wants.ids:
        out.pop("prompt_token_ids", None)
    if out.get("usage") is not None and not wants.usage:
        if not out.get("choices"):
            return None
        out.pop("usage")
    for choice in out.get("choices") or []:
        if not wants.ids:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        if not wants.logprobs and "logprobs" in choice:
            choice["logprobs"] = None
    if wants.model is not None:
        out["model"] = wants.model
    return out
