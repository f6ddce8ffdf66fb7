"""Reading a JSON request body on an aiohttp server: the one helper the deployment server and the proxy share.

``read_json_request(request)`` returns the parsed body or raises ``BodyError`` with the HTTP status to
answer and a message naming the problem:

| problem | status |
| --- | --- |
| ``Content-Encoding`` other than ``identity``, ``gzip`` or ``deflate`` (one coding, no stacking) | 415 |
| a ``gzip`` / ``deflate`` body that does not decode | 400 |
| the body did not arrive within ``timeout_s`` | 408 |
| not strict JSON (``parse_json_body`` in ``http.py``) | 400 (``param`` = the field at fault) |

The application's ``client_max_size`` caps the body after decoding (aiohttp answers 413), so a
small compressed body cannot inflate past it. aiohttp's parser decodes ``gzip`` / ``deflate``
itself; an undecodable one surfaces here as a payload error. A body longer than
``OFFLOAD_JSON_BYTES`` is parsed in a worker thread (``asyncio.to_thread``), so a 16 MB body
never stalls the event loop (and every other request on it) while it is decoded and checked.
"""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

from training.utils.http import JsonBodyError, parse_json_body

CONTENT_ENCODINGS = ("identity", "gzip", "deflate")
"""The request ``Content-Encoding`` values served (415 for any other)."""
OFFLOAD_JSON_BYTES = 1024 * 1024
"""Bodies longer than this are parsed off the event loop."""
BODY_READ_TIMEOUT_S = 60.0
"""A client must deliver its request body within this long (408 otherwise; a stalled upload holds a slot)."""


class BodyError(ValueError):
    """A request body that cannot be read: ``status`` to answer, ``param`` the top-level field at fault (or None)."""

    def __init__(self, status: int, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.status = status
        self.param = param


async def read_json_request(
    request: web.Request, *, timeout_s: float = BODY_READ_TIMEOUT_S, offload_bytes: int = OFFLOAD_JSON_BYTES
) -> Any:
    """The request's body decoded and parsed as strict JSON; ``BodyError`` names what is wrong (table above)."""
    encoding = request.headers.get("Content-Encoding", "").strip().lower() or "identity"
    if encoding not in CONTENT_ENCODINGS:
        raise BodyError(
            415,
            f"Content-Encoding {encoding!r} is not supported: send the body as one of {', '.join(CONTENT_ENCODINGS)}",
        )
    try:
        raw = await asyncio.wait_for(request.read(), timeout_s)
    except asyncio.TimeoutError:
        raise BodyError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    except (web.RequestPayloadError, ContentEncodingError) as e:
        reason = " ".join(str(e).split())
        raise BodyError(400, f"the request body is not valid {encoding} data (Content-Encoding): {reason}") from None
    try:
        if len(raw) > offload_bytes:
            return await asyncio.to_thread(parse_json_body, raw)
        return parse_json_body(raw)
    except JsonBodyError as e:
        raise BodyError(400, str(e), e.param) from None
