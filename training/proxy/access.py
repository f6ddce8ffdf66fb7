"""Who may do what on the proxy: the control key, per-session keys, and the session a request names.

The proxy has one control key (``ProxyServer.api_key``, held by the recipe). Each session gets its
own key, ``session_key(control_key, sid)`` = ``"sk-session-" + base64url(sid) + "." +
HMAC-SHA256(control_key, sid)``: nothing is stored, the proxy recomputes the MAC
(``session_of_key``), and the key names the one session it may act on.

| key | model calls | ``GET /sessions/{id}/calls``, rewards | ``/proxy/pause``, ``/proxy/resume`` |
| --- | --- | --- | --- |
| control key | any session | any session | yes |
| session key of S | session S only (403 otherwise) | session S only (403) | 403 |
| anything else | 401 | 401 | 401 |

``/health`` needs no key. A session id is printable ASCII of at most ``MAX_SESSION_ID_CHARS``
(it travels upstream in a header): anything else is a 400 naming where it came from.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from typing import Any, Callable, Mapping, Optional

from aiohttp import web

from training.utils.http import AFFINITY_HEADER, SESSION_HEADER
from training.openai_api.errors import error_response

SESSION_KEY_PREFIX = "sk-session-"
MAX_SESSION_ID_CHARS = 256
"""Longest session id accepted (ids are printable ASCII: they travel upstream in a header)."""
CONTROL_ROUTES = ("/proxy/pause", "/proxy/resume")
"""Routes only the control key may use."""
KEY_SESSION = "proxy_key_session"  # a plain key: web.RequestKey needs aiohttp >= 3.11, the floor is 3.9
"""Request slot: the session an agent's key is bound to (absent for the control key or no key)."""


def check_session_id(sid: str, source: str) -> Optional[str]:
    """The problem with session id ``sid`` (from ``source``, e.g. the header's name), or None when it is fine."""
    if len(sid) > MAX_SESSION_ID_CHARS:
        return f"{source}: the session id has {len(sid)} characters (at most {MAX_SESSION_ID_CHARS})"
    if not all(" " <= ch <= "~" for ch in sid):
        return f"{source}: the session id must be printable ASCII (it is sent upstream in a header), got {sid!r}"
    return None


def session_key(control_key: str, sid: str) -> str:
    """The API key bound to session ``sid`` (see the module docstring)."""
    mac = hmac.new(control_key.encode(), sid.encode(), hashlib.sha256).hexdigest()
    name = base64.urlsafe_b64encode(sid.encode()).decode().rstrip("=")
    return f"{SESSION_KEY_PREFIX}{name}.{mac}"


def session_of_key(control_key: str, key: str) -> Optional[str]:
    """The session a key is bound to, or None when it is not a valid session key of this proxy."""
    if not key.startswith(SESSION_KEY_PREFIX) or "." not in key:
        return None
    name, _, mac = key[len(SESSION_KEY_PREFIX) :].rpartition(".")
    try:
        sid = base64.urlsafe_b64decode(name + "=" * (-len(name) % 4)).decode()
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None
    return sid if hmac.compare_digest(session_key(control_key, sid).encode(), key.encode()) else None


def presented_key(headers: Mapping[str, str]) -> str:
    """The key a request presents: ``Authorization: Bearer <key>`` (OpenAI SDK), else ``x-api-key`` (Anthropic SDK)."""
    auth = headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer ") :]
    return headers.get("x-api-key", "")


def auth_middleware(control_key: Callable[[], Optional[str]]) -> Any:
    """The aiohttp middleware: the control key passes everywhere; a session key binds the request to its
    session (``KEY_SESSION``); anything else is a 401. ``control_key()`` None accepts every caller."""

    @web.middleware
    async def auth(request: web.Request, handler):
        key_of_proxy = control_key()
        if key_of_proxy and request.path != "/health":
            key = presented_key(request.headers)
            if not hmac.compare_digest(key.encode(errors="surrogateescape"), key_of_proxy.encode()):
                sid = session_of_key(key_of_proxy, key)
                if sid is None:
                    return error_response(401, "missing or wrong API key for the proxy", "authentication_error")
                if request.path in CONTROL_ROUTES:
                    return error_response(
                        403, f"{request.path} needs the proxy's control key, not a session's key", "permission_error"
                    )
                request[KEY_SESSION] = sid
        return await handler(request)

    return auth


def forbidden(request: web.Request, sid: str) -> Optional[web.Response]:
    """403 when the request's key is bound to another session than ``sid``; else None."""
    bound = request.get(KEY_SESSION)
    if bound is None or bound == sid:
        return None
    return error_response(
        403, f"this API key belongs to session {bound!r}; it cannot act on session {sid!r}", "permission_error"
    )


def named_session(request: web.Request, body: Any) -> tuple[Optional[str], str]:
    """(session id, where it came from): the URL ``/sessions/{id}``, a session header, the ``user`` field,
    else the session the agent's key is bound to."""
    if request.match_info.get("sid"):
        return request.match_info["sid"], "the URL path /sessions/{id}"
    for header in (SESSION_HEADER, AFFINITY_HEADER):
        if request.headers.get(header):
            return request.headers[header], f"the '{header}' header"
    user = body.get("user") if isinstance(body, dict) else None
    if isinstance(user, str) and user:
        return user, "the 'user' field"
    return request.get(KEY_SESSION), "the API key"
