"""The proxy: an OpenAI-compatible server an unmodified agent points its ``base_url`` at.

    async with ProxyServer(["http://127.0.0.1:8000"]) as proxy:
        client = openai.AsyncOpenAI(base_url=proxy.session_url("ep-1"), api_key=proxy.api_key)
        ...                                   # the agent runs; every call is recorded
        session = proxy.close_session("ep-1") # CallRecords with exact token ids and labels

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (session from the
``x-multi-turn-session-id`` header, else ``x-session-affinity``, else the body's ``user`` field),
``POST /v1/messages`` (Anthropic Messages API, see ``anthropic.py``) and the same under
``/sessions/{id}/v1/...`` for clients that cannot set headers; ``POST /v1/responses`` (the OpenAI
Responses API, recorded as a chat call: ``responses.py``); ``GET [/sessions/{id}]/v1/models``;
``GET /health``;
``POST /proxy/pause`` (add a pauser: new calls wait; answers once none is in flight, the stragglers cancelled
after ``drain_timeout_s``: ``pause_and_drain``), ``POST /proxy/resume``
(remove one: calls flow again when every pauser resumed; see ``training/utils/aio/pause_gate.py``);
``GET /sessions/{id}/calls`` (recorded calls and labels, for logs); ``POST /sessions/{id}/reward``
(or ``/proxy/reward`` with the session header): ``{"reward": x, "call": k}`` adds a per-call
reward the agent posts itself to call k (default its latest call; see ``transitions.py``).

Keys (``sessions.py``): ``api_key`` is the control key (the recipe's: every route, every session);
``session_key(sid)`` is an agent's, good for its own session only (403 elsewhere and on
pause / resume). Sessions are bounded (``max_sessions``, ``session_idle_s``; ``/health`` reports
the table). Bodies are read by ``training/utils/http.py`` (gzip / deflate, 415 for other
encodings, large JSON parsed off the event loop), as on the deployment server.

Contract: every call is forwarded with ``return_token_ids`` and logprobs on (``forwarding.py``), to the
replica chosen by the session's hash; the agent gets a normal OpenAI response (``tool_calls``
parsed, the token fields and logprobs removed unless it asked for them, its own ``model``
name echoed; ``stream: true`` gets SSE, see ``streaming.py``); the proxy records prompt ids,
output ids, logprobs, finish reason, weight version, messages and tools, and labels the call
(``turn_matching.assign``). Failure policy: upstream 5xx / unreachable → retried with backoff,
then 502 to the agent and the session is marked failed (a restarting replica is waited for and a call its
server died under is resent first, given ``restarts``); upstream 4xx → passed through
unrecorded and never retried without the refused field (an invalid or over-long ``max_tokens``
is the agent's 400). No agent stalls another or a sync: a streamed write the agent does not take within
``stream_write_timeout_s`` aborts that call (``write``), and it fails its episode (``SessionRecord.aborted_calls``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
from typing import Any, AsyncIterator, Optional

import aiohttp
from aiohttp import web

from training.proxy import anthropic, responses, sampling_policy
from training.proxy.forwarding import AGENT_HEADER, CallForwarder, label_headers, upstream_path
from training.proxy.records import SessionRecord
from training.proxy.access import auth_middleware, check_session_id, forbidden, named_session, session_key
from training.proxy.sessions import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_S, SessionTable, SessionTableFull
from training.proxy.streaming import (
    ClientStalled,
    StreamAccumulator,
    chat_chunks,
    client_body,
    client_chunk,
    completion_chunks,
    wanted_fields,
)
from training.proxy.upstream import Restarts, UpstreamError, UpstreamPool
from training.utils.http import SESSION_HEADER, close_idle_connections
from training.openai_api.errors import error_body, error_response
from training.utils.aio.pause_gate import PauseGate
from training.utils.config import ProxyConfig
from training.utils.http import BodyError, read_json_request
from training.utils.rl.rollout import RolloutValidationError, as_reward
from training.openai_api.sse import end_sse, iter_sse, open_sse, sse_event

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body after decoding (413 above it), as on the deployment server."""

DEFAULT_STREAM_WRITE_TIMEOUT_S = ProxyConfig.stream_write_timeout_s
"""How long one streamed write may wait for the agent to take the bytes before the proxy aborts the stream (30 s;
a recipe's ``Config.proxy.stream_write_timeout_s``)."""

DEFAULT_DRAIN_TIMEOUT_S = ProxyConfig.drain_timeout_s
"""How long a pause waits for the calls in flight before it cancels the stragglers (60 s; ``Config.proxy``)."""

CANCEL_GRACE_S = 5.0
"""How long a drain waits for cancelled calls to unwind (they release their in-flight count at once)."""


class ProxyServer:
    """Records every call of every session; see the module docstring for the contract."""

    def __init__(
        self,
        upstream_urls: list[str],
        *,
        upstream_api_key: Optional[str] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: Optional[str] = "auto",
        strategy: str = "messages",
        forced_params: Optional[dict[str, Any]] = None,
        default_max_tokens: Optional[int] = None,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        timeout_s: float = 600.0,
        upstream_stream: str = "auto",
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        session_idle_s: float = DEFAULT_SESSION_IDLE_S,
        constrained_calls: str = "exclude",
        stream_write_timeout_s: float = DEFAULT_STREAM_WRITE_TIMEOUT_S,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
        restarts: Optional[Restarts] = None,
    ):
        """``api_key="auto"`` makes a random key (``self.api_key``); None accepts any caller.

        ``forced_params`` overwrite the agent's sampling fields (the recipe forces its
        ``temperature`` so sampler logprobs match the trainer's); ``default_max_tokens`` caps
        a call whose agent sets no ``max_tokens``. ``upstream_stream``: for ``stream: true``
        calls, ``auto`` relays the upstream's stream until an upstream refuses ``stream`` (then
        synthesises the stream from a full reply), ``on`` always relays, ``off`` always synthesises.
        ``max_sessions`` / ``session_idle_s`` bound the session table (``sessions.py``).
        Sampling fields follow ``sampling_policy.py``; ``constrained_calls`` (``exclude`` / ``train``): whether
        a call sampled under constrained decoding is kept as context only or trained on.
        ``stream_write_timeout_s``: a streamed write the agent does not take within it aborts that response (the
        connection is closed, the call is recorded in ``SessionRecord.aborted_calls``: its episode is not trained).
        ``drain_timeout_s``: ``pause_and_drain`` waits this long for the calls in flight, then cancels the
        stragglers (counted in ``drain_cancelled_calls``, recorded as aborted) and returns.
        ``restarts``: the recipe's ``DeploymentSampler``; upstream calls then wait for a restarting replica and are
        resent when their server died under them, by the sampler's rules (``upstream.py``).
        """
        if not stream_write_timeout_s > 0 or not drain_timeout_s > 0:
            raise ValueError("stream_write_timeout_s and drain_timeout_s must be > 0")
        self.stream_write_timeout_s = float(stream_write_timeout_s)
        self.drain_timeout_s = float(drain_timeout_s)
        self.aborted_streams = 0
        """Streams aborted because the agent did not read them within ``stream_write_timeout_s``."""
        self.drain_cancelled_calls = 0
        """Calls a drain cancelled after ``drain_timeout_s`` (their episodes are not trained)."""
        self._calls: dict[asyncio.Task, tuple[web.Request, SessionRecord]] = {}
        self.pool = UpstreamPool(
            upstream_urls,
            api_key=upstream_api_key,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            restarts=restarts,
        )
        self.forwarder = CallForwarder(
            self.pool,
            strategy=strategy,
            forced_params=forced_params,
            default_max_tokens=default_max_tokens,
            upstream_stream=upstream_stream,
            constrained_calls=constrained_calls,
        )
        """Forwards, records and labels every call (``forwarding.py``): the routes' shared path to the upstream."""
        self.host, self.port = host, port
        self.api_key = secrets.token_hex(16) if api_key == "auto" else api_key
        self.table = SessionTable(max_sessions, session_idle_s)
        self.sessions = self.table.open
        """Open sessions by id (the table's dict)."""
        self.gate = PauseGate()
        """Holds new calls during a weight sync (counted pausers) and drains the calls in flight."""
        self._runner: Optional[web.AppRunner] = None
        self._reaper: Optional[asyncio.Task] = None

    # ---- lifecycle --------------------------------------------------------------------
    async def start(self) -> "ProxyServer":
        app = web.Application(middlewares=[auth_middleware(lambda: self.api_key)], client_max_size=MAX_BODY_BYTES)
        for prefix in ("", "/sessions/{sid}"):
            app.router.add_post(prefix + "/v1/chat/completions", self._chat)
            app.router.add_post(prefix + "/v1/completions", self._completions)
            app.router.add_post(prefix + "/v1/messages", self._messages)
            app.router.add_post(prefix + "/v1/responses", self._responses)
            app.router.add_get(prefix + "/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_post("/proxy/pause", self._pause_route)
        app.router.add_post("/proxy/resume", self._resume_route)
        app.router.add_get("/sessions/{sid}/calls", self._calls_route)
        app.router.add_post("/sessions/{sid}/reward", self._reward_route)
        app.router.add_post("/proxy/reward", self._reward_route)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self._reaper = asyncio.create_task(close_idle_connections(self._runner.server))
        await self.pool.open()
        return self

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
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
        """Open (or return) a session; ``ValueError`` for a closed or malformed id, or a full table."""
        problem = check_session_id(session_id, "session_id")
        if problem is not None:
            raise ValueError(problem)
        try:
            return self.table.admit(session_id)
        except SessionTableFull as e:
            raise ValueError(str(e)) from None

    def close_session(self, session_id: str) -> SessionRecord:
        """End a session: later calls get 410; returns (and forgets) its record."""
        return self.table.close(session_id)

    def session_key(self, session_id: str) -> Optional[str]:
        """The API key for an agent of ``session_id`` only (None when the proxy has no key)."""
        return session_key(self.api_key, session_id) if self.api_key else None

    # ---- weight sync: pause, drain, cancel the stragglers ------------------------------------
    async def pause_and_drain(self) -> int:
        """Add a pauser (new calls wait) and wait up to ``drain_timeout_s`` for the calls in flight; then cancel
        the ones left (their connections closed, each recorded in its session's ``aborted_calls``, so the episode
        is not trained) and return how many. The pause stays: ``gate.resume()`` it."""
        self.gate.pause()
        try:
            await self.gate.drain(self.drain_timeout_s)
            return 0
        except asyncio.TimeoutError:
            pass
        stragglers = [(task, req, s) for task, (req, s) in self._calls.items() if not task.done()]
        logger.warning(
            "proxy drain: %d call(s) still in flight after drain_timeout_s=%.1fs are cancelled (sessions %s)",
            len(stragglers),
            self.drain_timeout_s,
            sorted({s.session_id for _, _, s in stragglers}),
        )
        for task, req, session in stragglers:
            session.aborted_calls.append(f"cancelled by the pre-sync drain after {self.drain_timeout_s:g}s")
            if req.transport is not None:
                req.transport.abort()
            task.cancel()
        self.drain_cancelled_calls += len(stragglers)
        with contextlib.suppress(asyncio.TimeoutError):
            await self.gate.drain(CANCEL_GRACE_S)
        return len(stragglers)

    @contextlib.asynccontextmanager
    async def admitted(self, request: web.Request, session: SessionRecord) -> AsyncIterator[None]:
        """One agent call: waits while paused, counted in flight, and known to the drain (which may cancel it)."""
        async with self.gate.admitted():
            task = asyncio.current_task()
            self._calls[task] = (request, session)
            try:
                yield
            finally:
                self._calls.pop(task, None)

    async def write(self, request: web.Request, session: SessionRecord, resp: web.StreamResponse, data: bytes) -> None:
        """One streamed write, within ``stream_write_timeout_s``: else the connection is aborted, the call recorded
        in ``session.aborted_calls`` and ``ClientStalled`` raised (the handler returns ``ClientStalled.resp``)."""
        try:
            await asyncio.wait_for(resp.write(data), self.stream_write_timeout_s)
        except asyncio.TimeoutError:
            if request.transport is not None:
                request.transport.abort()
            self.aborted_streams += 1
            session.aborted_calls.append(
                f"stream aborted: the agent took no bytes for {self.stream_write_timeout_s:g}s"
            )
            logger.warning("proxy: session %s stopped reading its stream; aborted", session.session_id)
            raise ClientStalled(resp) from None

    # ---- routes -----------------------------------------------------------------------
    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ok",
                "paused": self.gate.paused,
                "pausers": self.gate.pausers,
                "in_flight": self.gate.in_flight,
                "aborted_streams": self.aborted_streams,
                "drain_cancelled_calls": self.drain_cancelled_calls,
                **self.table.stats(),
            }
        )

    async def _pause_route(self, request: web.Request) -> web.Response:
        """Add a pauser and answer once no call is in flight (stragglers cancelled after ``drain_timeout_s``)."""
        await self.pause_and_drain()
        return web.json_response({"status": "paused", "pausers": self.gate.pausers, "in_flight": self.gate.in_flight})

    async def _resume_route(self, request: web.Request) -> web.Response:
        """Remove one pauser: calls flow again only when every pauser resumed (409 when none is left)."""
        if not self.gate.paused:
            return error_response(409, "the proxy is not paused (every pause was already resumed)", "conflict_error")
        self.gate.resume()
        status = "paused" if self.gate.paused else "running"
        return web.json_response({"status": status, "pausers": self.gate.pausers})

    async def _calls_route(self, request: web.Request) -> web.Response:
        denied = forbidden(request, request.match_info["sid"])
        if denied is not None:
            return denied
        rec = self.sessions.get(request.match_info["sid"])
        if rec is None:
            return error_response(404, f"no open session {request.match_info['sid']!r}", "not_found_error")
        return web.json_response({"session_id": rec.session_id, "calls": [c.summary() for c in rec.calls]})

    async def _reward_route(self, request: web.Request) -> web.Response:
        """``{"reward": x, "call": k}``: the agent credits call k (default: its latest) with x."""
        body, session, err = await self.body_and_session(request)
        if err is not None:
            return err
        try:  # the rollout contract's check: a finite number within MAX_ABS_REWARD (a huge one overflows advantages)
            reward = as_reward(body.get("reward"))
        except RolloutValidationError as e:
            return error_response(400, str(e), param="reward")
        agent = request.headers.get(AGENT_HEADER)
        mine = [c.index for c in session.calls if agent is None or c.agent == agent]
        index = body.get("call", mine[-1] if mine else None)
        if index is None:
            return error_response(400, "no call to reward yet: post a reward after the call it is for", param="call")
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(session.calls):
            return error_response(
                400, f"'call' must be the index of a recorded call (0..{len(session.calls) - 1})", param="call"
            )
        session.calls[index].posted_rewards.append(float(reward))
        self.table.touch(session)
        return web.json_response({"call": index, "posted_rewards": session.calls[index].posted_rewards})

    async def _models(self, request: web.Request) -> web.Response:
        try:
            reply = await self.pool.request("GET", self.pool.base_urls[0], "/v1/models")
        except UpstreamError as e:
            return error_response(502, str(e), "upstream_error")
        return web.json_response(reply.body, status=reply.status)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "chat")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, "completions")

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI Responses API: translated to a chat call, recorded as one (see ``responses.py``)."""
        return await responses.serve(self, request)

    def _session_of(
        self, request: web.Request, body: Any = None
    ) -> tuple[Optional[SessionRecord], Optional[web.Response]]:
        sid, source = named_session(request, body)
        if not sid:
            return None, error_response(
                400,
                f"name the session: send the '{SESSION_HEADER}' (or 'x-session-affinity') "
                "header or the 'user' field, or use the base URL /sessions/{id}/v1",
            )
        problem = check_session_id(sid, source)
        if problem is not None:
            return None, error_response(400, problem, param="user" if source == "the 'user' field" else None)
        denied = forbidden(request, sid)
        if denied is not None:
            return None, denied
        reason = self.table.closed_reason(sid)
        if reason is not None:
            return None, error_response(410, f"session {sid!r} is closed ({reason})", "session_closed")
        try:
            return self.table.admit(sid), None
        except SessionTableFull as e:
            return None, error_response(503, str(e), "overloaded_error")

    async def body_and_session(
        self, request: web.Request
    ) -> tuple[Optional[dict], Optional[SessionRecord], Optional[web.Response]]:
        """What every model route reads first: ``(body, session, None)``, the request's JSON object and the session it
        names (from the URL, the headers or the ``user`` field; opened if new), or ``(None, None, error)``, the
        response to send instead: 400 for a body that is not a JSON object or no session named, 403 for another
        session's key, 410 for a closed session, 503 when the session table is full of sessions in flight."""
        body, err = await self._read_body(request)
        if err is not None:
            return None, None, err
        session, err = self._session_of(request, body)
        return body, session, err

    async def _read_body(self, request: web.Request) -> tuple[Optional[dict], Optional[web.Response]]:
        try:
            body = await read_json_request(request)
        except BodyError as e:
            return None, error_response(e.status, str(e), param=e.param)
        if not isinstance(body, dict):
            return None, error_response(400, "the request body must be a JSON object")
        return body, None

    async def _generate(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        body, session, err = await self.body_and_session(request)
        if err is not None:
            return err
        refused = sampling_policy.refusal(body)
        if refused is not None:
            return error_response(400, refused[1], param=refused[0])
        if not isinstance(body.get("stream", False), bool):
            return error_response(400, "'stream' must be a boolean", "stream")
        if not isinstance(body.get("stream_options") or {}, dict):
            return error_response(400, "'stream_options' must be an object", "stream_options")
        self.forwarder.stamp_seed(session, body)
        with self.table.active(session):  # a session with a call in flight is never evicted
            async with self.admitted(request, session):
                if body.get("stream"):
                    try:
                        return await self._stream(request, session, endpoint, body)
                    except ClientStalled as e:
                        return e.resp
                out = await self.forwarder.exchange(request, session, endpoint, body)
        if isinstance(out, web.Response):
            return out
        reply, record = out
        return web.json_response(client_body(reply, body, endpoint), headers=label_headers(record))

    async def _messages(self, request: web.Request) -> web.StreamResponse:
        """Anthropic Messages API: translated to a chat call, recorded as one (see ``anthropic.py``)."""
        body, session, err = await self.body_and_session(request)
        if err is not None:
            return err
        try:
            chat = anthropic.to_chat_request(body)
        except anthropic.AnthropicRequestError as e:
            return web.json_response(anthropic.error_body(str(e)), status=400)
        refused = sampling_policy.refusal(chat)
        if refused is not None:
            return web.json_response(anthropic.error_body(refused[1]), status=400)
        self.forwarder.stamp_seed(session, chat)
        with self.table.active(session):
            async with self.admitted(request, session):
                out = await self.forwarder.exchange(request, session, "chat", chat)
        if isinstance(out, web.Response):  # the same error in Anthropic's envelope
            err_body = json.loads(out.body) if out.body else {}
            message = (err_body.get("error") or {}).get("message", "upstream error")
            kind = "invalid_request_error" if out.status < 500 else "api_error"
            return web.json_response(anthropic.error_body(message, kind), status=out.status)
        reply, record = out
        message = anthropic.from_chat_response(reply, body.get("model"))
        if not chat["stream"]:
            return web.json_response(message, headers=label_headers(record))
        resp = await open_sse(request)
        try:
            for event, data in anthropic.stream_events(message):
                await self.write(request, session, resp, sse_event(data, event))
        except ClientStalled:
            return resp
        await resp.write_eof()
        return resp

    async def _stream(
        self, request: web.Request, session: SessionRecord, endpoint: str, body: dict
    ) -> web.StreamResponse:
        """``stream: true``: relay the upstream's stream, or synthesise one from its full reply (``streaming.py``)."""
        url = self.pool.pick(session.session_id)
        if self.forwarder.relays(url):
            resp = await self._relay(request, session, endpoint, body, url)
            if resp is not None:
                return resp
        out = await self.forwarder.exchange(request, session, endpoint, body)
        if isinstance(out, web.Response):
            return out
        reply, _ = out
        client = client_body(reply, body, endpoint)
        wants_usage = wanted_fields(body, endpoint).usage
        chunks = chat_chunks(client, wants_usage) if endpoint == "chat" else completion_chunks(client, wants_usage)
        resp = await open_sse(request)
        for chunk in chunks:
            await self.write(request, session, resp, sse_event(chunk))
        await end_sse(resp)
        return resp

    async def _relay(
        self, request: web.Request, session: SessionRecord, endpoint: str, body: dict, url: str
    ) -> Optional[web.StreamResponse]:
        """Stream from the upstream to the agent chunk by chunk while accumulating the exact tokens.

        None when the upstream refuses ``stream`` (a 400 naming it, ``upstream_stream="auto"``):
        the caller synthesises the stream instead, for this call and every later one to that upstream.
        """
        sid = session.session_id
        fwd = self.forwarder.upstream_body(body, endpoint)
        fwd.update(stream=True, stream_options={"include_usage": True})
        wants = wanted_fields(body, endpoint)
        acc = StreamAccumulator(endpoint)
        resp: Optional[web.StreamResponse] = None
        try:
            async with self.pool.stream(url, upstream_path(endpoint), fwd, headers={SESSION_HEADER: sid}) as up:
                if up.status != 200:
                    parsed = await up.json(content_type=None)
                    param = (parsed.get("error") or {}).get("param") if isinstance(parsed, dict) else None
                    if self.forwarder.stream_refused(url, up.status, param):
                        return None
                    return web.json_response(parsed, status=up.status)  # never retried without the field
                resp = await open_sse(request)
                async for chunk in iter_sse(up.content):
                    acc.add(chunk)
                    out = client_chunk(chunk, wants)
                    if out is not None:
                        await self.write(request, session, resp, sse_event(out))
        except UpstreamError as e:
            session.upstream_failed(str(e), deployment=True, lost=e.lost)
            return error_response(502, f"upstream failed: {e}", "upstream_error")
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:  # broke mid-stream
            broke = f"upstream stream broke: {type(e).__name__}: {e}"
            session.upstream_failed(broke, deployment=not isinstance(e, ValueError))  # a cut stream, or a bad chunk
            if resp is None:
                return error_response(502, session.upstream_errors[-1], "upstream_error")
            await resp.write(sse_event(error_body(session.upstream_errors[-1], "upstream_error")))
            await resp.write_eof()
            return resp
        record = await self.forwarder.commit(session, acc.reply(), endpoint, body, request, url)
        if record is None:
            await resp.write(sse_event(error_body(session.upstream_errors[-1], "upstream_error")))
        await end_sse(resp)
        return resp
