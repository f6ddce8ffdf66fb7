"""Streamed Responses API events, built from chat-completion chunks.

``ResponsesEventStream`` turns the chunks of a streamed chat reply (``chat.completion.chunk``: text in
``delta.content``, calls in ``delta.tool_calls``) into the events the ``openai`` SDK parses, each with a
``type`` and an increasing ``sequence_number`` (written as ``event: <type>`` + ``data: <json>``; the
stream ends after the last event, with no ``[DONE]``):

1. ``response.created``, ``response.in_progress`` (the response with ``status: "in_progress"``, no output);
2. per text run: ``response.output_item.added`` (a ``message`` item), ``response.content_part.added``
   (an ``output_text`` part), ``response.output_text.delta`` per piece, and when the item ends
   ``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``;
3. per tool call: ``response.output_item.added`` (a ``function_call`` item with its ``call_id`` and
   ``name``), ``response.function_call_arguments.delta``, ``response.function_call_arguments.done``,
   ``response.output_item.done``;
4. ``response.completed`` (``response.incomplete`` for a reply cut at ``length``) with the whole response:
   its ``output`` is exactly the items streamed (same ids, text and arguments), its ``usage`` and RL extras
   come from the full chat reply (``responses_output.rl_extras``). An error ends the stream with
   ``response.failed`` (``error.message``).

Deltas carry ``logprobs: []``; the per-token logprobs, when asked for, are on the final response.
"""

from __future__ import annotations

from typing import Any, Optional

from training.openai_api.responses_output import (
    call_item,
    call_item_id,
    finish_status,
    message_item,
    message_item_id,
    response_object,
    text_part,
)
from training.openai_api.responses_request import ResponsesRequest


class ResponsesEventStream:
    """The events of one streamed response, in order (see the module docstring)."""

    def __init__(self, rr: ResponsesRequest, response_id: str, created_at: int, model: str):
        self.rr, self.id, self.created_at, self.model = rr, response_id, created_at, model
        self.seq = 0
        self.items: list[dict] = []
        """Output items so far (finished ones complete; the open one is ``self.open``)."""
        self.open: Optional[dict] = None
        self.num_messages = 0
        self.calls: dict[int, dict] = {}
        """Chat call index -> its item."""
        self.finished = False

    def _event(self, kind: str, **fields: Any) -> dict:
        event = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return event

    def _response(self, status: str, reply: Optional[dict] = None) -> dict:
        return response_object(
            self.rr, self.id, self.created_at, model=self.model, status=status, output=self.items, reply=reply
        )

    def opening(self) -> list[dict]:
        response = self._response("in_progress")
        return [
            self._event("response.created", response=response),
            self._event("response.in_progress", response=response),
        ]

    def chat_chunk(self, chunk: dict) -> list[dict]:
        """The events one chat chunk adds (choice 0's text and tool-call deltas)."""
        out: list[dict] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text(delta["content"])
            for tc in delta.get("tool_calls") or []:
                out += self._call(tc)
        return out

    def _text(self, piece: str) -> list[dict]:
        out: list[dict] = []
        if self.open is None or self.open["type"] != "message":
            out += self._close()
            item_id = message_item_id(self.id, self.num_messages)
            self.num_messages += 1
            self.open = {**message_item(item_id, "", "in_progress"), "text": ""}
            out.append(
                self._event(
                    "response.output_item.added",
                    output_index=len(self.items),
                    item=message_item(item_id, "", "in_progress"),
                )
            )
            out.append(
                self._event(
                    "response.content_part.added",
                    item_id=item_id,
                    output_index=len(self.items),
                    content_index=0,
                    part=text_part(""),
                )
            )
        self.open["text"] += piece
        out.append(
            self._event(
                "response.output_text.delta",
                item_id=self.open["id"],
                output_index=len(self.items),
                content_index=0,
                delta=piece,
                logprobs=[],
            )
        )
        return out

    def _call(self, tc: dict) -> list[dict]:
        out: list[dict] = []
        index = tc.get("index", len(self.calls))
        fn = tc.get("function") or {}
        if index not in self.calls:
            out += self._close()
            item = call_item(
                call_item_id(self.id, len(self.calls)), tc.get("id") or "", fn.get("name") or "", "", "in_progress"
            )
            self.calls[index] = item
            self.open = item
            out.append(self._event("response.output_item.added", output_index=len(self.items), item=dict(item)))
            fn = {"arguments": fn.get("arguments")}
        item = self.calls[index]
        if item is not self.open:
            raise ValueError(f"tool call {index} continued after a later item began")
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            out.append(
                self._event(
                    "response.function_call_arguments.delta",
                    item_id=item["id"],
                    output_index=len(self.items),
                    delta=fn["arguments"],
                )
            )
        return out

    def _close(self, status: str = "completed") -> list[dict]:
        """Finish the open item (its done events) and add it to ``items``."""
        item, self.open = self.open, None
        if item is None:
            return []
        index = len(self.items)
        out = []
        if item["type"] == "message":
            text = item.pop("text")
            done = message_item(item["id"], text, status)
            out.append(
                self._event(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    text=text,
                    logprobs=[],
                )
            )
            out.append(
                self._event(
                    "response.content_part.done",
                    item_id=item["id"],
                    output_index=index,
                    content_index=0,
                    part=text_part(text),
                )
            )
        else:
            item["status"] = status
            done = item
            out.append(
                self._event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=index,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        self.items.append(done)
        out.append(self._event("response.output_item.done", output_index=index, item=dict(done)))
        return out

    def closing(self, reply: dict) -> list[dict]:
        """The last events, once the full chat ``reply`` (usage, token ids, logprobs) is known."""
        status = finish_status(reply)
        out = self._close(status)
        if not self.items:  # an empty reply is one empty message, as the whole response has
            out += self._text_item_empty(status)
        self.finished = True
        if self.rr.logprobs and len(self.items) == 1 and self.items[0]["type"] == "message":  # as the whole response
            entries = (reply["choices"][0].get("logprobs") or {}).get("content") or []
            self.items[0]["content"][0]["logprobs"] = list(entries)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return out + [self._event(kind, response=self._response(status, reply))]

    def _text_item_empty(self, status: str) -> list[dict]:
        item_id = message_item_id(self.id, self.num_messages)
        self.open = {**message_item(item_id, "", "in_progress"), "text": ""}
        out = [
            self._event("response.output_item.added", output_index=0, item=message_item(item_id, "", "in_progress")),
            self._event(
                "response.content_part.added", item_id=item_id, output_index=0, content_index=0, part=text_part("")
            ),
        ]
        return out + self._close(status)

    def failed(self, message: str) -> list[dict]:
        """``response.failed`` with ``message`` (after an error mid-stream)."""
        self.finished = True
        response = self._response("failed")
        response["error"] = {"code": "server_error", "message": message}
        return [self._event("response.failed", response=response)]

    @property
    def output(self) -> list[dict]:
        """The finished output items (after ``closing``)."""
        return list(self.items)
