"""What the embedded server's route handlers share: the app's keys, the JSON body reader and the
error envelope (server.py: generation and status routes; server_weights.py: weight routes)."""

from __future__ import annotations

import asyncio
from typing import Any, Optional

from aiohttp import web

from training.deployment.protocol import RequestError, error_body
from training.utils.http import JsonBodyError, parse_json_body

ENGINE_KEY = web.AppKey("engine", object)
SETTINGS_KEY = web.AppKey("settings", dict)


def json_error(
    status: int, message: str, err_type: str = "invalid_request_error", param: Optional[str] = None
) -> web.Response:
    return web.json_response(error_body(message, err_type, param), status=status)


BODY_READ_TIMEOUT_S = 60.0
"""A client must deliver its request body within this long (408 otherwise; a stalled upload holds a slot)."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body (413 above it)."""


async def read_json(request: web.Request) -> Any:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s", status=408) from None
    try:
        return parse_json_body(raw)
    except JsonBodyError as e:
        raise RequestError(str(e), e.param) from e
