"""The OpenAI error envelope, the one shape every error of the server and the proxy takes.

``{"error": {"message": ..., "type": ..., "param": ..., "code": null}}``: ``message`` says what is
wrong, ``type`` is ``invalid_request_error`` unless told (``authentication_error``,
``internal_error``, ``upstream_error``, ...), ``param`` names the offending request field or is
null. The same body is sent as a JSON response (``error_response``) or, after the first byte of a
stream, as one SSE event (``training/openai_api/sse.py``).
"""

from __future__ import annotations

from typing import Optional

from aiohttp import web

INVALID_REQUEST = "invalid_request_error"
"""The default error ``type``: the client sent something wrong."""


def error_body(message: str, err_type: str = INVALID_REQUEST, param: Optional[str] = None) -> dict:
    """The envelope as a dict."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": None}}


def error_response(
    status: int, message: str, err_type: str = INVALID_REQUEST, param: Optional[str] = None
) -> web.Response:
    """The envelope as a JSON response with HTTP ``status``."""
    return web.json_response(error_body(message, err_type, param), status=status)
