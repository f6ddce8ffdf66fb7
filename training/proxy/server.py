"""The proxy: an OpenAI-compatible server an unmodified agent points its ``base_url`` at.

    async with ProxyServer(["http://127.0.0.1:8000"]) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.session_url("ep-1"), api_key=proxy.api_key)
        ...                                   # the agent runs; every call is recorded
        session = proxy.close_session("ep-1") # CallRecords with exact token ids and labels

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (session from the
``x-multi-turn-session-id`` header, else ``x-session-affinity``, else the body's ``user`` field)
and the same under ``/sessions/{id}/v1/...`` for clients that cannot set headers;
``GET [/sessions/{id}]/v1/models``; ``GET /health``;
``POST /proxy/pause`` (block new calls, wait for in-flight ones), ``POST /proxy/resume``;
``GET /sessions/{id}/calls`` (recorded calls and labels, for logs).

Contract: every call is forwarded with ``return_token_ids`` and logprobs on, to the replica
chosen by the session's hash; the agent gets a normal OpenAI response (``tool_calls``
parsed, the token fields and logprobs removed unless it asked for them, its own ``model``
name echoed); the proxy records prompt ids, output ids, logprobs, finish reason, weight
version, messages and tools, and labels the call (``turn_matching.assign``). Failure policy:
upstream 5xx / unreachable → retried with backoff, then 502 to the agent and the session
is marked failed; upstream 4xx → passed through unrecorded; an agent ``max_tokens`` that
does not fit the context → dropped and the call retried once (generation then stops at the
context end with ``finish_reason="length"``).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import secrets
from typing import Any, Optional

from aiohttp import web

from training.proxy.records import CallRecord, SessionRecord
from training.proxy.upstream import UpstreamError, UpstreamPool
from training.utils.http import SESSION_HEADER, bearer_ok, parse_json_body, session_headers, session_id_of
from training.utils.rl.rollout.turn_matching import STRATEGIES, assign

logger = logging.getLogger(__name__)

AGENT_HEADER = "x-agent-name"
_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def _error(status: int, message: str, err_type: str = "invalid_request_error", param: Optional[str] = None):
    return web.json_response({"error": {"message": message, "type": err_type, "param": param, "code": None}},
                             status=status)


async def _json_or_none(request: web.Request) -> Any:
    """The request's JSON body, or None when it is not JSON (the caller reports that; aiohttp keeps the body)."""
    try:
        return parse_json_body(await request.read())
    except ValueError:
        return None


class ProxyServer:
    """Records every call of every session; see the module docstring for the contract."""

    def __init__(self, upstream_urls: list[str], *, upstream_api_key: Optional[str] = None,
                 host: str = "127.0.0.1", port: int = 0, api_key: Optional[str] = "auto",
                 strategy: str = "messages", forced_params: Optional[dict[str, Any]] = None,
                 default_max_tokens: Optional[int] = None, max_retries: int = 3, backoff_s: float = 0.5,
                 timeout_s: float = 600.0):
        """``api_key="auto"`` makes a random key (``self.api_key``); None accepts any caller.

        ``forced_params`` overwrite the agent's sampling fields (the recipe forces its
        ``temperature`` so sampler logprobs match the trainer's); ``default_max_tokens`` caps
        a call whose agent sets no ``max_tokens``.
        """
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: {strategy!r} is not one of {STRATEGIES}")
        self.pool = UpstreamPool(upstream_urls, api_key=upstream_api_key, timeout_s=timeout_s,
                                 max_retries=max_retries, backoff_s=backoff_s)
        self.host, self.port = host, port
        self.api_key = secrets.token_hex(16) if api_key == "auto" else api_key
        self.strategy = strategy
        self.forced_params = dict(forced_params or {})
        self.default_max_tokens = default_max_tokens
        self.sessions: dict[str, SessionRecord] = {}
        self.closed_ids: set[str] = set()
        self.in_flight = 0
        self._admit = asyncio.Event()
        self._admit.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._runner: Optional[web.AppRunner] = None

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> "ProxyServer":
        app = web.Application(middlewares=[self._auth], client_max_size=64 * 1024 * 1024)
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/proxy/pause", self._pause_route)
        app.router.add_post("/proxy/resume", self._resume_route)
        app.router.add_get("/sessions/{sid}/calls", self._calls_route)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        await self.pool.open()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.pool.close()

    async def __aenter__(self) -> "ProxyServer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def base_url(self) -> str:
        """``http://host:port/v1`` (name the session with the header)."""
        return f"http://{self.host}:{self.port}/v1"

    def session_url(self, session_id: str) -> str:
        """A per-episode base URL for clients that cannot set headers."""
        return f"http://{self.host}:{self.port}/sessions/{session_id}/v1"

    # ---- sessions -----------------------------------------------------------------------
    def open_session(self, session_id: str) -> SessionRecord:
        if session_id in self.closed_ids:
            raise ValueError(f"session_id: {session_id!r} was already closed")
        return self.sessions.setdefault(session_id, SessionRecord(session_id))

    def close_session(self, session_id: str) -> SessionRecord:
        """End a session: later calls get 410; returns (and forgets) its record."""
        self.closed_ids.add(session_id)
        rec = self.sessions.pop(session_id, None) or SessionRecord(session_id)
        rec.closed = True
        return rec

    # ---- weight sync ------------------------------------------------------------------
    def pause(self) -> None:
        """New calls wait (they are not refused) until ``resume``."""
        self._admit.clear()

    def resume(self) -> None:
        self._admit.set()

    async def drain(self, timeout_s: Optional[float] = None) -> None:
        """Wait until no call is in flight (call ``pause`` first, or new ones keep arriving)."""
        await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def pause_and_drain(self, timeout_s: Optional[float] = None) -> None:
        self.pause()
        await self.drain(timeout_s)

    # ---- routes -----------------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if self.api_key and request.path != "/health":
            if not bearer_ok(request.headers.get("Authorization"), self.api_key):
                return _error(401, "missing or wrong API key for the proxy", "authentication_error")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "paused": not self._admit.is_set(), "in_flight": self.in_flight,
                                  "sessions": len(self.sessions)})

    async def _pause_route(self, request: web.Request) -> web.Response:
        await self.pause_and_drain()
        return web.json_response({"status": "paused", "in_flight": self.in_flight})

    async def _resume_route(self, request: web.Request) -> web.Response:
        self.resume()
        return web.json_response({"status": "running"})

    async def _calls_route(self, request: web.Request) -> web.Response:
        rec = self.sessions.get(request.match_info["sid"])
        if rec is None:
            return _error(404, f"no open session {request.match_info['sid']!r}", "not_found_error")
        return web.json_response({"session_id": rec.session_id, "calls": [c.summary() for c in rec.calls]})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            reply = await self.pool.request("GET", self.pool.base_urls[0], "/v1/models")
        except UpstreamError as e:
            return _error(502, str(e), "upstream_error")
        return web.json_response(reply.body, status=reply.status)

    async def _chat(self, request: web.Request) -> web.Response:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.Response:
        return await self._generate(request, "completions")

    def _session_of(self, request: web.Request, body: Any) -> tuple[Optional[SessionRecord], Optional[web.Response]]:
        sid = request.match_info.get("sid") or session_id_of(request.headers, body)
        if not sid:
            return None, _error(400, f"name the session: send the '{SESSION_HEADER}' (or 'x-session-affinity') "
                                     "header or the 'user' field, or use the base URL /sessions/{id}/v1")
        if sid in self.closed_ids:
            return None, _error(410, f"session {sid!r} is closed (its rollout is over)", "session_closed")
        return self.sessions.setdefault(sid, SessionRecord(sid)), None

    async def _generate(self, request: web.Request, endpoint: str) -> web.Response:
        session, err = self._session_of(request, await _json_or_none(request))
        if err is not None:
            return err
        try:
            body = parse_json_body(await request.read())
        except ValueError as e:
            return _error(400, str(e))
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        if body.get("stream"):
            return _error(400, "'stream' is not supported by the training proxy; call without streaming", "stream")
        if (body.get("n") or 1) != 1:
            return _error(400, "'n' must be 1 behind the training proxy (one recorded choice per call)", "n")
        await self._admit.wait()
        self.in_flight += 1
        self._idle.clear()
        try:
            return await self._forward(request, session, endpoint, body)
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def _upstream_body(self, body: dict, endpoint: str) -> dict:
        fwd = dict(body)
        fwd.pop("model", None)  # the upstream serves one policy; the agent's model name is echoed back
        fwd["return_token_ids"] = True
        if endpoint == "chat":
            fwd["logprobs"] = True
        else:
            fwd["logprobs"] = body.get("logprobs") or 0
        fwd.update(self.forced_params)
        if self.default_max_tokens is not None and not any(body.get(k) for k in _MAX_TOKEN_FIELDS):
            fwd["max_tokens"] = self.default_max_tokens
        return fwd

    async def _forward(self, request: web.Request, session: SessionRecord, endpoint: str,
                       body: dict) -> web.Response:
        sid = session.session_id
        path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
        url = self.pool.pick(sid)
        fwd = self._upstream_body(body, endpoint)
        clamped = False
        try:
            reply = await self.pool.request("POST", url, path, fwd, headers=session_headers(sid))
            err = reply.body.get("error") if isinstance(reply.body, dict) else None
            if reply.status == 400 and err and err.get("param") in _MAX_TOKEN_FIELDS:
                for k in _MAX_TOKEN_FIELDS:
                    fwd.pop(k, None)
                clamped = True
                reply = await self.pool.request("POST", url, path, fwd, headers=session_headers(sid))
        except UpstreamError as e:
            session.upstream_errors.append(str(e))
            return _error(502, f"upstream failed: {e}", "upstream_error")
        if reply.status != 200:
            return web.json_response(reply.body, status=reply.status)
        try:
            record = self._record(reply.body, endpoint, body, request, url, clamped)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            msg = f"upstream response lacks token-level detail ({type(e).__name__}: {e})"
            session.upstream_errors.append(msg)
            return _error(502, msg, "upstream_error")
        async with session.lock:
            label = assign(session, record, self.strategy)
        headers = {"x-proxy-call-label": label.kind, "x-proxy-call-index": str(record.index)}
        return web.json_response(self._client_body(reply.body, body, endpoint), headers=headers)

    @staticmethod
    def _record(out: dict, endpoint: str, body: dict, request: web.Request, url: str, clamped: bool) -> CallRecord:
        choice = out["choices"][0]
        prompt_ids = choice.get("prompt_token_ids") or out["prompt_token_ids"]
        output_ids = list(choice["token_ids"])
        if endpoint == "chat":
            logprobs = [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []]
            msg = choice["message"]
            response_message = {"role": "assistant", "content": msg.get("content")}
            if msg.get("tool_calls"):
                response_message["tool_calls"] = msg["tool_calls"]
        else:
            logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            response_message = None
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(output_ids)} output tokens")
        usage = out.get("usage") or {}
        agent = request.headers.get(AGENT_HEADER) or body.get("user") or "default"
        return CallRecord(index=-1, endpoint=endpoint, agent=str(agent), prompt_ids=list(prompt_ids),
                          output_ids=output_ids, output_logprobs=logprobs,
                          finish_reason=str(choice.get("finish_reason")),
                          weight_version=int(choice.get("weight_version", out.get("weight_version", -1))),
                          upstream=url, messages=copy.deepcopy(body.get("messages")) if endpoint == "chat" else None,
                          tools=copy.deepcopy(body.get("tools")) if endpoint == "chat" else None,
                          response_message=response_message,
                          cached_tokens=int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                          max_tokens_clamped=clamped)

    @staticmethod
    def _client_body(out: dict, body: dict, endpoint: str) -> dict:
        """The upstream response as the agent asked for it: token fields only on request."""
        out = copy.deepcopy(out)
        wants_ids = bool(body.get("return_token_ids"))
        wants_logprobs = bool(body.get("logprobs")) if endpoint == "chat" else body.get("logprobs") is not None
        if not wants_ids:
            out.pop("prompt_token_ids", None)
        for choice in out.get("choices", []):
            if not wants_ids:
                choice.pop("token_ids", None)
                choice.pop("prompt_token_ids", None)
            if not wants_logprobs:
                choice["logprobs"] = None
            msg = choice.get("message")
            if isinstance(msg, dict) and not msg.get("tool_calls"):
                msg.pop("tool_calls", None)
        if isinstance(body.get("model"), str):
            out["model"] = body["model"]
        return out
