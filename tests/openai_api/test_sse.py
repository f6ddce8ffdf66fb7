"""The shared wire pieces (``training/openai_api/sse.py``, ``training/openai_api/errors.py``): what one
side writes the other reads back unchanged."""

from __future__ import annotations

import asyncio
import json

from training.openai_api.errors import error_body, error_response
from training.openai_api.sse import DONE, iter_sse, sse_event


async def _lines(raw: bytes):
    for line in raw.splitlines(keepends=True):
        yield line


def _read(raw: bytes) -> list:
    async def go():
        return [e async for e in iter_sse(_lines(raw))]

    return asyncio.run(go())


def test_written_events_read_back_until_done():
    events = [{"text": "héllo\nworld"}, {"n": 1}, error_body("broke", "upstream_error")]
    raw = b": keep-alive\n\n" + sse_event(events[0], "delta") + b"".join(sse_event(e) for e in events[1:])
    raw += DONE + sse_event({"after": "done"})
    assert _read(raw) == events  # comments and event names skipped, nothing after [DONE]
    assert sse_event({"a": "é"}) == 'data: {"a": "é"}\n\n'.encode()  # UTF-8, not \\u escapes


def test_multi_line_data_is_joined_and_a_stream_may_end_without_done():
    assert _read(b'data: {"a":\ndata: 1}\n\ndata: {"b": 2}\n') == [{"a": 1}, {"b": 2}]


def test_error_envelope_has_the_four_openai_fields():
    resp = error_response(400, "'n' must be 1", param="n")
    assert resp.status == 400
    assert json.loads(resp.body) == {
        "error": {"message": "'n' must be 1", "type": "invalid_request_error", "param": "n", "code": None}
    }
