"""Upstream deployments: session affinity by hash and retried POSTs.

``UpstreamPool.pick(session_id)`` maps a session to one replica by a stable hash (SHA-256,
not Python's salted ``hash``), so every call of a session lands on the same server and its
KV cache is reused. ``post`` retries connection errors and 5xx with exponential backoff
(``backoff_s * 2**k``, ``max_retries`` times); a 4xx is returned at once. ``stream`` does the
same before handing over the open response of a streamed call (no retry once bytes flow).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from dataclasses import dataclass
from typing import Any, AsyncIterator, Optional

import aiohttp

from training.utils.http import auth_headers

logger = logging.getLogger(__name__)


class UpstreamError(RuntimeError):
    """The upstream failed (5xx or unreachable) after every retry."""


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
    ):
        if not base_urls:
            raise ValueError("upstream_urls: at least one deployment base URL is needed")
        self.base_urls = [self._normalise(u) for u in base_urls]
        self.api_key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
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

    async def request(
        self, method: str, url: str, path: str, body: Optional[dict] = None, headers: Optional[dict[str, str]] = None
    ) -> UpstreamReply:
        """Send with retries on connection errors and 5xx; raise ``UpstreamError`` when they run out."""
        await self.open()
        h = auth_headers(self.api_key, headers)
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with self._http.request(method, url + path, json=body, headers=h) as resp:
                    text = await resp.text()
                    try:
                        parsed = await resp.json(content_type=None)
                    except ValueError:
                        parsed = {"error": {"message": text[:2000]}}
                    if resp.status < 500:
                        return UpstreamReply(resp.status, parsed, url)
                    last = f"HTTP {resp.status}: {text[:500]}"
            except (aiohttp.ClientConnectionError, ConnectionError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            logger.warning(
                "upstream %s%s failed (attempt %d of %d): %s", url, path, attempt + 1, self.max_retries + 1, last
            )
        raise UpstreamError(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")

    @contextlib.asynccontextmanager
    async def stream(
        self, url: str, path: str, body: dict, headers: Optional[dict[str, str]] = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """POST ``body`` and yield the open response (status < 500) to read as it arrives.

        Connection errors and 5xx are retried like ``request``; ``UpstreamError`` when they run out.
        """
        await self.open()
        h = dict(headers or {})
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                resp = await self._http.post(url + path, json=body, headers=h)
            except (aiohttp.ClientConnectionError, ConnectionError, asyncio.TimeoutError) as e:
                last = f"{type(e).__name__}: {e}"
            else:
                if resp.status < 500:
                    try:
                        yield resp
                    finally:
                        resp.release()
                    return
                last = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                resp.release()
            logger.warning(
                "upstream %s%s failed (attempt %d of %d): %s", url, path, attempt + 1, self.max_retries + 1, last
            )
        raise UpstreamError(f"{url}{path} failed after {self.max_retries + 1} attempts: {last}")
