"""``RequestError``: a client error the server answers with a 4xx in the OpenAI error envelope."""

from __future__ import annotations

from typing import Optional


class RequestError(Exception):
    """A client error: ``status`` (400 unless told), the problem, the offending field."""

    def __init__(
        self, message: str, param: Optional[str] = None, *, status: int = 400, err_type: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.err_type = err_type
