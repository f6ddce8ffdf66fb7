"""The small HTTP pieces every client and server of this package shares.

- ``auth_headers`` / ``bearer_ok``: the one place the ``Authorization: Bearer <key>`` header is
  written and checked (constant-time).
- ``control_request``: a blocking JSON request for control calls from threads that have no event
  loop (health checks, the launcher's watchdog reloading weights after a restart).
- ``free_port``: a port that was free a moment ago, for launching servers.
- ``session_id_of``: the multi-turn session a request belongs to (``x-multi-turn-session-id``, else
  ``x-session-affinity``, else the body's ``user`` field): the one rule the server (KV reuse), the
  sampler and the proxy (replica affinity, recording) share.
- ``parse_json_body``: a request body as JSON, strictly (valid UTF-8, no NaN / Infinity, integers
  within 64 bits, nesting at most ``MAX_JSON_DEPTH``, no lone surrogates); anything else is a
  ``ValueError`` whose message a server returns as its 400.
- ``close_idle_connections``: a server-side sweeper that closes connections which have sent no
  complete request for ``IDLE_CONNECTION_TIMEOUT_S`` (half-open or slow-header clients).

The sampler keeps one pooled session per event loop for its many requests
(``training/deployment/client.py``); one-off control calls open a session per call.

``read_json_request(request)`` reads a JSON request body on an aiohttp server (the deployment server and
the proxy share it): the parsed body, or ``BodyError`` with the HTTP status to answer and a message naming
the problem:

| problem | status |
| --- | --- |
| ``Content-Encoding`` other than ``identity``, ``gzip`` or ``deflate`` (one coding, no stacking) | 415 |
| a ``gzip`` / ``deflate`` body that does not decode | 400 |
| the body did not arrive within ``timeout_s`` | 408 |
| not strict JSON (``parse_json_body`` above) | 400 (``param`` = the field at fault) |

The application's ``client_max_size`` caps the body after decoding (aiohttp answers 413), so a
small compressed body cannot inflate past it. aiohttp's parser decodes ``gzip`` / ``deflate``
itself; an undecodable one surfaces here as a payload error. A body longer than
``OFFLOAD_JSON_BYTES`` is parsed in a worker thread (``asyncio.to_thread``), so a 16 MB body
never stalls the event loop (and every other request on it) while it is decoded and checked.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Mapping, Optional

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError

SESSION_HEADER = "x-multi-turn-session-id"
"""Header naming a request's multi-turn session (KV reuse across turns, one replica per session)."""
AFFINITY_HEADER = "x-session-affinity"
"""The same session id under the name sticky-routing load balancers use; read when ``SESSION_HEADER`` is absent."""


def session_id_of(headers: Mapping[str, str], body: Any = None) -> Optional[str]:
    """A request's session id: ``SESSION_HEADER``, else ``AFFINITY_HEADER``, else ``body["user"]`` (a non-empty
    string); None when none is given."""
    for name in (SESSION_HEADER, AFFINITY_HEADER):
        value = headers.get(name)
        if value:
            return value
    user = body.get("user") if isinstance(body, dict) else None
    return user if isinstance(user, str) and user else None


def session_headers(session_id: Optional[str]) -> dict[str, str]:
    """Both session headers for ``session_id`` (empty for None): our servers read the first, routers the second."""
    return {SESSION_HEADER: session_id, AFFINITY_HEADER: session_id} if session_id else {}


def auth_headers(api_key: Optional[str], extra: Optional[dict[str, str]] = None) -> dict[str, str]:
    """``{"Authorization": "Bearer <key>"}`` when a key is set (plus ``extra``), else ``extra`` or {}."""
    headers = dict(extra or {})
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return headers


def bearer_ok(header_value: Optional[str], api_key: str) -> bool:
    """True if an ``Authorization`` header carries exactly ``Bearer <api_key>`` (constant-time compare)."""
    return hmac.compare_digest((header_value or "").encode(), f"Bearer {api_key}".encode())


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def control_request(
    method: str,
    url: str,
    body: Optional[dict] = None,
    *,
    api_key: Optional[str] = None,
    timeout: float = 10.0,
    params: Optional[dict] = None,
) -> tuple[int, str]:
    """A blocking JSON request: ``(status, text)``; status 0 (and the error text) when unreachable."""
    if params:
        url = f"{url}?{urllib.parse.urlencode(params)}"
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers=auth_headers(api_key))
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
        return 0, str(e)


MAX_JSON_DEPTH = 64
"""Deepest nesting a request body may have (OpenAI bodies need fewer than 10 levels)."""
MAX_JSON_INT = 2**64
"""Integers in a request body must lie in (-MAX_JSON_INT, MAX_JSON_INT)."""


IDLE_CONNECTION_TIMEOUT_S = 30.0
"""Seconds a server connection may stay without a request in progress (headers not yet complete, or
kept alive between requests) before it is closed. Above the aiohttp client's 15 s keep-alive, so a
pooled client connection is dropped by the client first."""


async def close_idle_connections(server: Any, idle_timeout_s: float = IDLE_CONNECTION_TIMEOUT_S) -> None:
    """Close every connection of an aiohttp ``server`` (``AppRunner.server``) that has had no request in
    progress for ``idle_timeout_s``; runs until cancelled.

    aiohttp has no timeout for the header phase (and before 3.10 none for a connection that never
    sends a byte), so without this a client can hold connections open forever. A handler whose request
    state cannot be read is treated as busy (never closed)."""
    idle_since: dict[Any, float] = {}
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(min(1.0, idle_timeout_s / 4))
        now, seen = loop.time(), set()
        for handler in server.connections:
            seen.add(handler)
            if getattr(handler, "_current_request", True) is not None:  # busy with a request
                idle_since.pop(handler, None)
            elif now - idle_since.setdefault(handler, now) >= idle_timeout_s:
                transport = getattr(handler, "transport", None)
                if transport is not None:
                    transport.close()
        for handler in set(idle_since) - seen:
            del idle_since[handler]


class JsonBodyError(ValueError):
    """A request body that ``parse_json_body`` refuses; ``param`` is the top-level field at fault, if any."""

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def parse_json_body(raw: bytes) -> Any:
    """Decode a request body strictly (see the module docstring); ``JsonBodyError`` names the problem."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise JsonBodyError(f"the request body is not valid UTF-8: {e}") from None
    depth = 0
    for ch in text:  # cheap pre-check, so the decoder never recurses deeply
        if ch in "[{":
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise JsonBodyError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
        elif ch in "]}":
            depth -= 1
    try:
        body = json.loads(text)
    except RecursionError:
        raise JsonBodyError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:  # includes JSONDecodeError and integers of more than 4300 digits
        raise JsonBodyError(f"the request body is not valid JSON: {e}") from None
    stack: list[tuple[Any, str, Optional[str]]] = [(body, "body", None)]
    while stack:
        value, where, field = stack.pop()
        if isinstance(value, dict):
            stack.extend((v, f"{where}.{k}", field or str(k)) for k, v in value.items())
            stack.extend((k, f"{where} key", field) for k in value)
        elif isinstance(value, list):
            stack.extend((v, f"{where}[{i}]", field) for i, v in enumerate(value))
        elif isinstance(value, bool):
            continue
        elif isinstance(value, int) and not -MAX_JSON_INT < value < MAX_JSON_INT:
            raise JsonBodyError(f"{where}: integer out of range (must be within +-2**64)", field)
        elif isinstance(value, float) and not math.isfinite(value):
            raise JsonBodyError(f"{where}: {value} is not a number JSON allows", field)
        elif isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise JsonBodyError(
                    f"{where}: contains a lone surrogate escape (not valid Unicode text)", field
                ) from None
    return body


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
