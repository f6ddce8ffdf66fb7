"""Streamed responses: engine deltas -> OpenAI chunks, sent as server-sent events.

Wire format (as OpenAI): every event is ``data: <json>\\n\\n``, the last is ``data: [DONE]\\n\\n``
(framed by ``training/openai_api/sse.py``, which the proxy uses too).
Each chunk carries one choice (``n > 1`` and several prompts interleave by ``index``):

- completions: ``{"object": "text_completion", "choices": [{"index", "text", "logprobs",
  "finish_reason", "stop_reason"}]}``;
- chat: ``{"object": "chat.completion.chunk", "choices": [{"index", "delta", "logprobs",
  "finish_reason", "stop_reason"}]}``; the first chunk of a choice has ``delta.role``, text
  arrives as ``delta.content``, tool calls (in the format of the server's ``tool_call_parser``, ``req.tool_parser``)
  as ``delta.tool_calls`` (per call: one entry with
  ``index``, ``id``, ``type`` and ``function.name`` with empty arguments, then one with the
  ``function.arguments`` string), and the last chunk has an empty delta and the finish reason.

Exact tokens: with ``return_token_ids`` a chunk's choice has the ``token_ids`` it added and their
``token_weight_versions`` (the weight version that sampled each; the first chunk of a choice also
``prompt_token_ids``); with logprobs, the logprobs of exactly
those tokens. Concatenated over the stream they equal the whole response's lists. The last
chunk of a choice has its ``weight_version``; ``stream_options.include_usage`` adds a final
chunk with ``choices: []`` and ``usage`` (every other chunk then has ``usage: null``). A chat request
with ``tools`` has ``tool_rendering`` on every chunk, as on the whole response.

Text is decoded incrementally and never shows part of a stop string: text that could be the
start of one is held back until it is not (or the engine ends the sequence, when the rest
comes from the finished ``text``). An error after the first byte is one ``data: {"error": ...}``
event before ``[DONE]``.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Optional

from training.deployment.engine.requests import GenerationDelta, GenerationResult
from training.deployment.server.protocol import ParsedRequest
from training.openai_api.tool_parsers import HermesToolParser, ToolParser, to_openai_tool_calls
from training.deployment.server.bodies import (
    chat_finish_reason,
    chat_logprobs,
    completion_logprobs,
    response_version,
    usage,
)

log = logging.getLogger(__name__)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class IncrementalText:
    """Decodes a growing token list into text deltas, holding back incomplete characters and stop strings.

    Decoding re-reads only the tokens since the previous emission point (offsets as in vLLM's
    detokenizer), with ``skip_special_tokens`` like the engine's ``text``.
    """

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.prefix_offset = self.read_offset = 0
        self.decoded = ""
        """Text of the tokens so far (may run ahead of what was sent)."""
        self.sent = 0
        """Characters of ``decoded`` already sent."""

    def add(self, token_ids: list[int]) -> str:
        """The text these tokens make safe to send."""
        self.ids += token_ids
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        before = decode(self.ids[self.prefix_offset : self.read_offset])
        now = decode(self.ids[self.prefix_offset :])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.decoded += now[len(before) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        end = len(self.decoded)
        for s in self.stop:
            full = self.decoded.find(s, max(0, self.sent - len(s) + 1))
            end = min(end, full if full >= 0 else end, len(self.decoded) - _partial_suffix(self.decoded, s))
        piece = self.decoded[self.sent : end] if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def finish(self, final_text: str) -> str:
        """The rest of the finished ``text`` (what was sent is always a prefix of it, but see below)."""
        sent = self.decoded[: self.sent]
        if final_text.startswith(sent):
            return final_text[len(sent) :]
        log.warning(
            "streamed text diverged from the final text (tokenizer decode is not prefix-stable); "
            "the rest of the text is not streamed, the token ids are exact"
        )
        return ""


class ToolCallStream:
    """Splits streamed text into content and the tool calls of ``parser``'s format, in order.

    The parser's facts say where calls are (``training/openai_api/tool_parsers/base.py``): a region opens at one
    of its ``call_open`` strings (or at the reply's start, ``opens_at_start``) and ends at ``call_close`` (None:
    at the end of the reply). Each region is parsed by ``parser`` when it ends (a trailing unclosed region at the
    end, as the whole-response parser does); its calls are sent, each whole; a region that gives no call is
    sent as content. Whitespace follows the whole response (content outside the blocks, stripped once a call
    was made): trailing whitespace is held until more content follows, and dropped at the end of a reply with
    calls; leading whitespace is dropped when a call came first.
    """

    def __init__(self, parser: Optional[ToolParser] = None, tools: Optional[list[dict]] = None):
        self.parser = parser or HermesToolParser()
        self.tools = tools
        self.buf = ""
        self.in_call = False
        self.region_open = ""
        """The ``call_open`` string of the region being read ("" for a region that opens the reply)."""
        self.num_calls = 0
        self.sent_content = False
        self.pending_ws = ""
        self.id_prefix = f"call_{uuid.uuid4().hex[:16]}_"

    def feed(self, text: str) -> list[dict]:
        """Chat deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``text`` completes."""
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[dict]:
        """The deltas left at the end of the reply."""
        out = self._drain(final=True)
        if self.pending_ws and not self.num_calls:
            out.append({"content": self.pending_ws})
        self.pending_ws = ""
        return out

    def _at_start(self, final: bool) -> Optional[bool]:
        """Whether the reply opens with a call region (None: too little text yet to tell)."""
        if self.sent_content or self.num_calls or not self.parser.opens_at_start:
            return False
        head = self.buf.lstrip()
        if any(head.startswith(m) for m in self.parser.opens_at_start):
            return True
        if not final and any(m.startswith(head) for m in self.parser.opens_at_start):
            return None
        return False

    def _drain(self, final: bool) -> list[dict]:
        out: list[dict] = []
        opens, close = self.parser.call_open, self.parser.call_close
        while True:
            if not self.in_call:
                start = self._at_start(final)
                if start is None:
                    return out
                if start:
                    self.in_call, self.region_open = True, ""
                    continue
                found = [(i, m) for m in opens for i in [self.buf.find(m)] if i >= 0]
                if not found:
                    keep = 0 if final else max((_partial_suffix(self.buf, m) for m in opens), default=0)
                    self._content(self.buf[: len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep :]
                    return out
                i, marker = min(found)
                self._content(self.buf[:i], out)
                self.buf, self.in_call, self.region_open = self.buf[i + len(marker) :], True, marker
            i = self.buf.find(close) if close else -1
            if i < 0 and not final:
                return out
            body = self.buf if i < 0 else self.buf[:i]
            self.buf, self.in_call = ("" if i < 0 else self.buf[i + len(close) :]), False
            self._call(self.region_open + body + (close if i >= 0 else ""), out=out)

    def _content(self, text: str, out: list[dict]) -> None:
        text = self.pending_ws + text
        body = text.rstrip()
        self.pending_ws = text[len(body) :]
        if not self.sent_content and self.num_calls:
            body = body.lstrip()
        if body:
            self.sent_content = True
            out.append({"content": body})

    def _call(self, block: str, out: list[dict]) -> None:
        parsed = self.parser.parse(block, id_prefix=self.id_prefix, first_index=self.num_calls, tools=self.tools)
        if not parsed.calls or parsed.errors:
            self._content(block, out)
            return
        for call in to_openai_tool_calls(parsed.calls):
            index = self.num_calls
            self.num_calls += 1
            out.append(
                {
                    "tool_calls": [
                        {
                            "index": index,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": call["function"]["name"], "arguments": ""},
                        }
                    ]
                }
            )
            out.append({"tool_calls": [{"index": index, "function": {"arguments": call["function"]["arguments"]}}]})
        if parsed.content:
            self._content(parsed.content, out)


class ChoiceStream:
    """One choice of a streamed request: engine deltas -> that choice's entries of chunks."""

    def __init__(self, req: ParsedRequest, chat: bool, index: int, prompt: list[int], tokenizer: Any):
        self.req, self.chat, self.index, self.prompt, self.tokenizer = req, chat, index, prompt, tokenizer
        self.text = IncrementalText(tokenizer, req.params.stop)
        self.tools = ToolCallStream(req.tool_parser, req.tools) if chat and req.parse_tool_calls else None
        self.offset = 0
        self.first = True
        self.result: Optional[GenerationResult] = None

    def opening(self) -> list[dict]:
        """Chat: the role chunk every choice starts with."""
        if not self.chat:
            return []
        return [
            self._tokens_info(
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                },
                GenerationDelta([], [], None),
            )
        ]

    def update(self, delta: GenerationDelta) -> list[dict]:
        """The choice entries (one per chunk) this delta produces."""
        res = delta.result
        piece = self.text.finish(res.text) if res is not None else self.text.add(delta.token_ids)
        wants_tokens = bool(delta.token_ids) and (self.req.return_token_ids or self.req.logprobs is not None)
        if not self.chat:
            if not (piece or wants_tokens or res):
                return []
            entry = self._tokens_info(
                {"index": self.index, "text": piece, "logprobs": None, "finish_reason": None, "stop_reason": None},
                delta,
            )
            return [self._finished(entry, res, res.finish_reason) if res is not None else entry]
        if self.tools is not None:
            deltas = self.tools.feed(piece) + (self.tools.finish() if res is not None else [])
        else:
            deltas = [{"content": piece}] if piece else []
        if wants_tokens and not deltas:
            deltas = [{}]
        entries = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if entries:
            entries[0] = self._tokens_info(entries[0], delta)
        if res is not None:
            reason = chat_finish_reason(res, bool(self.tools and self.tools.num_calls))
            entries.append(self._finished({"index": self.index, "delta": {}, "logprobs": None}, res, reason))
        return entries

    def _tokens_info(self, entry: dict, delta: GenerationDelta) -> dict:
        req = self.req
        if req.return_token_ids:
            entry["token_ids"] = list(delta.token_ids)
            entry["token_weight_versions"] = list(delta.weight_versions)
            if self.first:
                entry["prompt_token_ids"] = list(self.prompt)
        self.first = False
        if req.logprobs is not None and delta.token_ids:
            if self.chat:
                entry["logprobs"] = chat_logprobs(
                    self.tokenizer, req, delta.token_ids, delta.logprobs, delta.top_logprobs
                )
            else:
                entry["logprobs"] = completion_logprobs(
                    self.tokenizer, req, delta.token_ids, delta.logprobs, delta.top_logprobs, self.offset
                )
                self.offset += sum(len(s) for s in entry["logprobs"]["tokens"])
        return entry

    def _finished(self, entry: dict, res: GenerationResult, reason: str) -> dict:
        self.result = res
        entry.update(finish_reason=reason, stop_reason=res.stop_reason, weight_version=res.weight_version)
        return entry


class ChunkStream:
    """The chunks of one streamed request, in the order they are sent."""

    def __init__(self, req: ParsedRequest, chat: bool, tokenizer: Any):
        self.req, self.chat = req, chat
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.choices = [
            [ChoiceStream(req, chat, p * req.n + i, prompt, tokenizer) for i in range(req.n)]
            for p, prompt in enumerate(req.prompts)
        ]

    def _chunk(self, choices: list[dict]) -> dict:
        out = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.req.model,
            "choices": choices,
        }
        if self.req.include_usage:
            out["usage"] = None
        if self.req.tool_rendering is not None:
            out["tool_rendering"] = self.req.tool_rendering
        return out

    def opening(self) -> list[dict]:
        return [self._chunk([e]) for row in self.choices for c in row for e in c.opening()]

    def update(self, prompt_index: int, choice_index: int, delta: GenerationDelta) -> list[dict]:
        return [self._chunk([e]) for e in self.choices[prompt_index][choice_index].update(delta)]

    def closing(self) -> list[dict]:
        """The usage chunk (``include_usage``), once every choice finished."""
        if not self.req.include_usage:
            return []
        results = [[c.result for c in row] for row in self.choices]
        return [{**self._chunk([]), "usage": usage(self.req, results), "weight_version": response_version(results)}]
