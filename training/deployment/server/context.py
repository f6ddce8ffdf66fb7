"""What the embedded server's route handlers share: the app's keys and the JSON body reader
(app.py: generation and status routes; weight_routes.py, sleep_routes.py, responses_route.py). The error envelope is
``training/openai_api/errors.py`` (shared with the proxy)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from training.deployment.server.protocol import RequestError
from training.utils.http import BodyError, read_json_request

ENGINE_KEY = web.AppKey("engine", object)
SETTINGS_KEY = web.AppKey("settings", dict)

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body after decoding its Content-Encoding (413 above it)."""


async def read_json(request: web.Request) -> Any:
    """The body via the helper the proxy shares (``training/utils/http.py``: encodings, 408, off-loop parse)."""
    try:
        return await read_json_request(request)
    except BodyError as e:
        raise RequestError(str(e), e.param, status=e.status) from e
