"""Server-sent events as the OpenAI API frames them: the one writer and the one reader.

Every event is ``[event: NAME\\n]data: <json>\\n\\n``; an OpenAI stream ends with ``DONE``
(``data: [DONE]\\n\\n``), an Anthropic one with its ``message_stop`` event. JSON is written with
``ensure_ascii=False`` (UTF-8 on the wire). The server (``training/deployment/server/app.py``) and the
proxy (``training/proxy/server.py``) write with these; the proxy reads an upstream's stream with
``iter_sse``. ``open_sse`` starts a stream, ``sse_event`` frames each event, ``end_sse`` ends it.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Optional

from aiohttp import web

DONE = b"data: [DONE]\n\n"
"""The last event of an OpenAI stream."""


def sse_event(data: Any, event: Optional[str] = None) -> bytes:
    """One event: ``[event: NAME\\n]data: JSON\\n\\n``."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n".encode()


async def open_sse(request: web.Request) -> web.StreamResponse:
    """A prepared ``text/event-stream`` response (headers sent) to write events to."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    return resp


async def end_sse(resp: web.StreamResponse) -> None:
    """End an OpenAI stream: ``DONE``, then close the response."""
    await resp.write(DONE)
    await resp.write_eof()


async def iter_sse(lines: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The parsed JSON ``data`` of each event of an SSE byte-line stream, until ``[DONE]`` or the end.

    Multi-line ``data`` is joined with newlines; comments, ``event:`` lines and blank keep-alives are
    skipped; a payload that is not JSON raises ``ValueError`` (``json.JSONDecodeError``).
    """
    data: list[str] = []
    async for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
        if line.startswith("data:"):
            data.append(line[5:].lstrip())
            continue
        if line or not data:
            continue
        payload, data = "\n".join(data), []
        if payload == "[DONE]":
            return
        yield json.loads(payload)
    if data and "\n".join(data) != "[DONE]":
        yield json.loads("\n".join(data))
