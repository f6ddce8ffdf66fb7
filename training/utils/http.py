"""The small HTTP pieces every client and server of this package shares.

- ``auth_headers`` / ``bearer_ok``: the one place the ``Authorization: Bearer <key>`` header is
  written and checked (constant-time).
- ``control_request``: a blocking JSON request for control calls from threads that have no event
  loop (health checks, the launcher's watchdog reloading weights after a restart).
- ``request_json``: the asyncio counterpart over an ``aiohttp`` session, raising the caller's
  error type with the URL, status and the server's message.
- ``free_port``: a port that was free a moment ago, for launching servers.

The sampler keeps one pooled session per event loop for its many requests
(``training/deployment/sampler.py``); one-off control calls open a session per call.
"""

from __future__ import annotations

import hmac
import json
import socket
import urllib.error
import urllib.parse
import urllib.request
from typing import Any, Optional


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


def control_request(method: str, url: str, body: Optional[dict] = None, *, api_key: Optional[str] = None,
                    timeout: float = 10.0, params: Optional[dict] = None) -> tuple[int, str]:
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


async def request_json(session: Any, method: str, url: str, body: Optional[dict] = None, *,
                       api_key: Optional[str] = None, params: Optional[dict] = None,
                       error: type[Exception] = RuntimeError) -> Any:
    """Send one JSON request on an ``aiohttp`` session; return the decoded answer (text if not JSON).

    An answer >= 400 raises ``error("<url>: HTTP <status>: <text>")``.
    """
    async with session.request(method, url, json=body, params=params, headers=auth_headers(api_key)) as resp:
        text = await resp.text()
        if resp.status >= 400:
            raise error(f"{url}: HTTP {resp.status}: {text[:2000]}")
        try:
            return json.loads(text) if text else None
        except ValueError:
            return text
