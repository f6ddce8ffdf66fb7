"""Upstream deployments: session affinity by hash and retried POSTs.

``UpstreamPool.pick(session_id)`` maps a session to one replica by a stable hash (SHA-256,
not Python's salted ``hash``), so every call of a session lands on the same server and its
KV cache is reused. ``request`` retries connection errors and 5xx with exponential backoff
(``backoff_s * 2**k``, ``max_retries`` times); a 4xx is returned at once. ``stream`` does the
same before handing over the open response of a streamed call (no retry once bytes flow).

Restarts: given ``restarts`` (the recipe's ``DeploymentSampler``, which knows each launched replica's
supervisor), every attempt first waits for a restarting replica (``restarts.wait_ready``), and an attempt
that failed because its server died under it is resent with the same body once the server is back,
without spending a retry (``restarts.resend_after_restart``): the sampler's own rules, counted in its
``restart_waits`` / ``restart_retries``. A replica that cannot come back ends the call with an
``UpstreamError`` whose ``lost`` is the sampler's ``DeploymentLostError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional, Protocol, TypeVar

import aiohttp

from training.utils.http import auth_headers

logger = logging.getLogger(__name__)


T = TypeVar("T")


class UpstreamError(RuntimeError):
    """The upstream failed (5xx or unreachable) after every retry, or its server cannot come back (``lost``)."""

    def __init__(self, message: str, lost: Optional[Exception] = None):
        super().__init__(message)
        self.lost = lost
        """What ``Restarts.wait_ready`` raised when the replica's server cannot come back (the sampler's
        ``DeploymentLostError``: the rollout re-raises it and the run stops)."""


class Restarts(Protocol):
    """The supervisor's view of the replicas that the pool asks: ``DeploymentSampler`` has both
    (``training/deployment/client.py``; the proxy never imports it, the recipe hands it over)."""

    async def wait_ready(self, url: str) -> None:
        """Return once ``url`` is ready; raise (``DeploymentLostError``) when it cannot come back."""

    def resend_after_restart(self, url: str) -> bool:
        """Whether a request to ``url`` that just failed is resent (its server died under it), counting it."""


@dataclass
class UpstreamReply:
    status: int
    body: Any
    """Parsed JSON (or ``{"error": {"message": text}}`` when the reply was not JSON)."""
    url: str


def affinity_index(session_id: str, n: int) -> int:
    """Replica index of ``session_id`` among ``n`` (stable across processes and runs)."""
    return int.from_bytes(hashlib.sha256(session_id.encode()).digest()[:8], "big") % n


class UpstreamPool:
    """One or more deployment base URLs (``http://host:port``, with or without ``/v1``)."""

    def __init__(
        self,
        base_urls: list[str],
        *,
        api_key: Optional[str] = None,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        restarts: Optional[Restarts] = None,
    ):
        if not base_urls:
            raise ValueError("upstream_urls: at least one deployment base URL is needed")
        self.base_urls = [self._normalise(u) for u in base_urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.restarts = restarts
        """Waits for restarting replicas and says when to resend (module docstring); None: the plain retries."""
        self._http: Optional[aiohttp.ClientSession] = None

    @staticmethod
    def _normalise(url: str) -> str:
        url = url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url

    def pick(self, session_id: str) -> str:
        """The replica that serves every call of ``session_id``."""
        return self.base_urls[affinity_index(session_id, len(self.base_urls))]

    async def open(self) -> None:
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def _send(self, url: str, path: str, attempt_once: Callable[[], Awaitable[tuple[Optional[T], str]]]) -> T:
        """Run ``attempt_once()`` (the result, or None and why it failed) under the retry and restart rules."""
        attempt = 0
        while True:
            if self.restarts is not None:
                try:
                    await self.restarts.wait_ready(url)
                except Exception as e:  # the replica cannot come back (the protocol's only raise)
                    raise UpstreamError(f"{url}{path}: its server cannot come back: {e}", lost=e) from e
            result, last = await attempt_once()
            if result is not None:
                return result
            if self.restarts is not None and self.restarts.resend_after_restart(url):
                logger.warning("upstream %s%s failed as its server died (%s); resent once it is back", url, path, last)
                continue
            attempt += 1
            logger.warning(
                "upstream %s%s failed (attempt %d of %d): %s", url, path, attempt, self.max_retries + 1, last
            )
            if attempt > self.max_retries:
                raise UpstreamError(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")
            await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))

    async def request(
        self, method: str, url: str, path: str, body: Optional[dict] = None, headers: Optional[dict[str, str]] = None
    ) -> UpstreamReply:
        """Send with retries on connection errors and 5xx (and the restart rules); raise ``UpstreamError`` when they
        run out."""
        await self.open()
        h = auth_headers(self.api_key, headers)

        async def once() -> tuple[Optional[UpstreamReply], str]:
            try:
                async with self._http.request(method, url + path, json=body, headers=h) as resp:
                    text = await resp.text()
                    try:
                        parsed = await resp.json(content_type=None)
                    except ValueError:
                        parsed = {"error": {"message": text[:2000]}}
                    if resp.status < 500:
                        return UpstreamReply(resp.status, parsed, url), ""
                    return None, f"HTTP {resp.status}: {text[:500]}"
            except (aiohttp.ClientConnectionError, ConnectionError, asyncio.TimeoutError) as e:
                return None, f"{type(e).__name__}: {e}"

        return await self._send(url, path, once)

    @contextlib.asynccontextmanager
    async def stream(
        self, url: str, path: str, body: dict, headers: Optional[dict[str, str]] = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST ``body`` and yield the open response (status < 500) to read as it arrives.

        Connection errors and 5xx are retried like ``request``; ``UpstreamError`` when they run out.
        """
        await self.open()
        h = auth_headers(self.api_key, headers)

        async def once() -> tuple[Optional[aiohttp.ClientResponse], str]:
            try:
                resp = await self._http.post(url + path, json=body, headers=h)
            except (aiohttp.ClientConnectionError, ConnectionError, asyncio.TimeoutError) as e:
                return None, f"{type(e).__name__}: {e}"
            if resp.status < 500:
                return resp, ""
            last = f"HTTP {resp.status}: {(await resp.text())[:500]}"
            resp.release()
            return None, last

        resp = await self._send(url, path, once)
        try:
            yield resp
        finally:
            resp.release()
