"""A cap on the server's concurrent connections: beyond it the server still answers, with a 503.

Without a cap, idle connections pile up until the process runs out of file descriptors; the
kernel then queues new connections that are never accepted, so even ``/health`` goes dark (and
the idle reaper never sees them). ``CappedTCPSite`` accepts every connection: the first
``max_connections`` are served by aiohttp as usual; the next ``OVERFLOW_RESERVE`` get one short
answer (``GET /health`` its usual body, anything else ``503`` with ``Retry-After``) and are
closed within ``OVERFLOW_TIMEOUT_S``; any further one is closed at once.
"""

from __future__ import annotations

import asyncio
import json
import resource
from typing import Any, Callable, Optional

from aiohttp import web

OVERFLOW_RESERVE = 64
"""Connections beyond the cap that still get an answer (the rest are closed at once)."""
OVERFLOW_TIMEOUT_S = 2.0
"""An over-cap connection must send its request head within this long; it is closed after it."""
FD_RESERVE = 256
"""File descriptors kept free of connections (model files, pipes, threads, the overflow reserve)."""
RETRY_AFTER_S = 1
"""``Retry-After`` of the 503 answer, in seconds."""
_MAX_HEAD = 8192


def default_max_connections() -> int:
    """The process's file-descriptor limit less ``FD_RESERVE`` (at least 16, at most 4096)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft - FD_RESERVE))


def _http(status: str, body: dict, extra: str = "") -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
        f"Connection: close\r\n{extra}\r\n"
    )
    return head.encode() + data


class _Overflow(asyncio.Protocol):
    """One over-cap connection: read the request head, answer once, close."""

    def __init__(self, site: "CappedTCPSite"):
        self.site, self.buf, self.transport = site, b"", None
        self.answered, self.timer = False, None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.site.overflow += 1
        self.timer = asyncio.get_running_loop().call_later(OVERFLOW_TIMEOUT_S, transport.abort)

    def data_received(self, data: bytes) -> None:
        if self.answered:
            return  # drained: the client may still be sending a body we do not read
        self.buf += data
        if b"\r\n\r\n" not in self.buf and len(self.buf) < _MAX_HEAD:
            return
        self.answered = True
        line = self.buf.split(b"\r\n", 1)[0].split(b" ")
        if len(line) == 3 and line[0] == b"GET" and line[1].split(b"?", 1)[0] == b"/health":
            self.transport.write(_http("200 OK", self.site.health()))
        else:
            message = f"the server is at its connection limit ({self.site.max_connections}); retry shortly"
            body = {"error": {"message": message, "type": "server_busy", "param": None, "code": 503}}
            self.transport.write(_http("503 Service Unavailable", body, f"Retry-After: {RETRY_AFTER_S}\r\n"))
        if self.transport.can_write_eof():
            self.transport.write_eof()  # then wait for the client's close (or the timer)
        else:
            self.transport.close()

    def eof_received(self) -> bool:
        self.transport.close()
        return False

    def connection_lost(self, exc: Optional[BaseException]) -> None:
        self.site.overflow -= 1
        if self.timer is not None:
            self.timer.cancel()


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: Any) -> None:
        transport.abort()


class CappedTCPSite(web.TCPSite):
    """A ``web.TCPSite`` whose aiohttp server handles at most ``max_connections`` connections at once.

    ``health()`` returns the JSON body that ``GET /health`` gets on an over-cap connection.
    """

    def __init__(
        self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int, health: Callable[[], dict]
    ):
        super().__init__(runner, host, port, reuse_address=True)
        self.max_connections, self.health, self.overflow = max_connections, health, 0
        self.bound_port = port
        """The port it listens on once started (the system's choice when ``port`` is 0)."""

    def _protocol(self) -> asyncio.BaseProtocol:
        server = self._runner.server
        if len(server.connections) < self.max_connections:
            return server()
        if self.overflow < OVERFLOW_RESERVE:
            return _Overflow(self)
        return _Refuse()

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self._protocol, self._host, self._port, backlog=self._backlog, reuse_address=self._reuse_address
        )
        self.bound_port = self._server.sockets[0].getsockname()[1] if self._server.sockets else self._port
