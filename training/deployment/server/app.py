"""aiohttp application over an ``AsyncEngine``: OpenAI-compatible endpoints + weight control.

Endpoints (see README.md for bodies):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: generation, token-level detail on request;
  ``prompt_logprobs`` (completions) adds each prompt token's logprob from a scoring forward.
- ``POST /v1/responses``: the OpenAI Responses API over the chat path (``responses_route.py``).
- ``GET /v1/models``, ``GET /health`` (never needs the API key), ``GET /weight_version``, ``GET /stats``.
- ``POST /update_weights_from_disk``, ``POST /update_weights_from_shm``, ``POST /pause``, ``POST /resume``.
- ``POST /sleep?level=1|2``, ``POST /wake_up``, ``GET /is_sleeping``: colocation (server/sleep_routes.py).
- ``POST /init_weight_update_group``, ``POST /update_weights_from_distributed``: the torch.distributed
  path (the trainer broadcasts tensors; see ``weights/distributed.py``, ``server/distributed_receiver.py``).

Contract: a bad request gets 400 with the OpenAI error envelope naming the field and never
disturbs other requests; a refused weight update gets 400 and the old weights stay live;
a request that finds the engine's waiting queue full (``EngineConfig.max_waiting``) gets 503 with
``Retry-After``, the connection cap's busy answer (``connection_limit.py``), and nothing already
accepted is dropped; every generation response carries ``weight_version``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional

from aiohttp import web

from training.deployment.server.connection_limit import RETRY_AFTER_S
from training.deployment.engine.requests import (
    EngineBusyError,
    EngineDeadError,
    EngineError,
    GenerationResult,
    SequenceFailedError,
    WeightUpdateError,
)
from training.deployment.server.protocol import (
    ParsedRequest,
    RequestError,
    parse_chat_request,
    parse_completion_request,
)
from training.deployment.server.limits import DEFAULT_LIMITS, RequestLimits
from training.deployment.server.bodies import build_chat_response, build_completion_response
from training.deployment.server.responses_route import RESPONSES_KEY, responses_routes
from training.deployment.server.kernel_caches import kernel_cache_bounds
from training.deployment.server.process_stats import process_pools
from training.deployment.server.context import (
    ENGINE_KEY,
    MAX_BODY_BYTES,
    SETTINGS_KEY,
    read_json,
)
from training.deployment.server.sleep_routes import sleep_routes
from training.deployment.server.weight_routes import DIST_KEY, LOOPBACK_PEERS, shm_roots, weight_routes
from training.deployment.server.streaming import ChunkStream
from training.utils.http import bearer_ok, session_id_of
from training.openai_api.errors import error_body, error_response
from training.openai_api.responses_store import ResponseStore
from training.openai_api.sse import end_sse, open_sse, sse_event
from training.openai_api.tool_parsers import AUTO, ToolParser, select_tool_parser

log = logging.getLogger(__name__)

_OPEN_PATHS = ("/health",)
"""Paths that never require the API key."""


_CANCEL_ON_DISCONNECT = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""Paths whose handler is cancelled (and sequences aborted) when the client disconnects."""


@web.middleware
async def _errors_and_auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
    """API-key check (all paths but /health) and the mapping of errors to JSON responses."""
    api_key = request.app[SETTINGS_KEY].get("api_key")
    if api_key and request.path not in _OPEN_PATHS:
        if not bearer_ok(request.headers.get("Authorization"), api_key):
            return error_response(
                401, "missing or wrong API key: send 'Authorization: Bearer <key>'", "authentication_error"
            )
    try:
        if request.path in _CANCEL_ON_DISCONNECT:
            return await handler(request)
        # a control request (weights, pause, ...) runs to its end even if its client goes away: a weight
        # push cut half-way would leave a joined group unrecorded or a /dev/shm file behind
        return await _run_to_end(handler(request))
    except RequestError as e:
        return error_response(e.status, e.message, e.err_type, e.param)
    except WeightUpdateError as e:
        return error_response(400, f"weight update refused: {e}", "invalid_request_error")
    except EngineError as e:
        return error_response(400, str(e), "invalid_request_error", _engine_error_param(str(e)))
    except EngineBusyError as e:  # the waiting queue is full: the same answer as the connection cap's
        resp = error_response(503, str(e), "server_busy")
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
        return resp
    except EngineDeadError as e:  # the engine thread is gone: nothing here will ever generate again
        return error_response(503, str(e), "engine_dead")
    except SequenceFailedError as e:  # this request's sequence failed inside a step; the others went on
        log.error("request failed in the engine: %s", e)
        return error_response(500, f"generation failed: {e}", "internal_error")
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as e:  # a server bug: log it, answer 500, keep serving
        log.exception("unhandled error on %s", request.path)
        return error_response(500, f"internal server error: {type(e).__name__}: {e}", "internal_error")


async def _run_to_end(coro: Awaitable[web.StreamResponse]) -> web.StreamResponse:
    """Await ``coro`` in its own task that a cancellation of the caller does not stop (its outcome is then dropped)."""
    task = asyncio.ensure_future(coro)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" log
        raise


def _engine_error_param(message: str) -> Optional[str]:
    """The request field an engine message ("prompt_token_ids[3]: ...") is about."""
    head = message.split(":", 1)[0].split("[", 1)[0].strip()
    if not head or " " in head:
        return None
    return {"prompt_token_ids": "prompt"}.get(head, head)


async def _parse(request: web.Request, parse: Callable[..., ParsedRequest], body: Any) -> ParsedRequest:
    """Validate and tokenize (or render the chat template) in the app's one tokenizer thread, off the event
    loop, so a long prompt does not stall /health and every other request (one thread: HF tokenizers are
    not safe to call concurrently)."""
    pool = request.app[SETTINGS_KEY]["tokenize_pool"]
    settings = request.app[SETTINGS_KEY]
    names, limits, tool_parser = settings["served_names"], settings["limits"], settings["tool_parser"]
    return await asyncio.get_running_loop().run_in_executor(
        pool, parse, body, request.app[ENGINE_KEY], names, limits, tool_parser
    )


def _session_id(request: web.Request, body: Any, choice: int) -> Optional[str]:
    """Engine session of a choice: the request's session id (``x-multi-turn-session-id``, else
    ``x-session-affinity``, else the body's ``user``) for choice 0, ``<id>:<i>`` for the others."""
    sid = session_id_of(request.headers, body)
    if not sid:
        return None
    return sid if choice == 0 else f"{sid}:{choice}"


async def _generate_all(request: web.Request, req: ParsedRequest, body: Any) -> list[list[Any]]:
    """Run every (prompt, choice) as its own engine request, concurrently; results[p][i].

    The first error (or a client disconnect) cancels the request's other choices.
    """
    engine = request.app[ENGINE_KEY]
    tasks = [
        [
            asyncio.ensure_future(engine.generate(prompt, req.params_for(i), session_id=_session_id(request, body, i)))
            for i in range(req.n)
        ]
        for prompt in req.prompts
    ]
    flat = [t for row in tasks for t in row]
    try:
        await asyncio.gather(*flat)
    except BaseException:
        for t in flat:
            t.cancel()
        await asyncio.gather(*flat, return_exceptions=True)
        raise
    return [[t.result() for t in row] for row in tasks]


async def _stream(request: web.Request, req: ParsedRequest, body: Any, chat: bool) -> web.StreamResponse:
    """Answer with server-sent events; every (prompt, choice) streams from its own engine request.

    A client that goes away (a failed write, or aiohttp cancelling the handler) cancels the
    consumers, which aborts their sequences at the engine's next step.
    """
    engine = request.app[ENGINE_KEY]
    chunks = ChunkStream(req, chat, engine.tokenizer)
    queue: asyncio.Queue = asyncio.Queue()

    async def consume(p: int, i: int) -> None:
        try:
            async for delta in engine.generate_stream(
                req.prompts[p], req.params_for(i), session_id=_session_id(request, body, i)
            ):
                queue.put_nowait((p, i, delta))
        except Exception as e:  # reported in the stream; the other choices are cancelled
            queue.put_nowait((p, i, e))

    resp = await open_sse(request)
    tasks = [asyncio.ensure_future(consume(p, i)) for p in range(len(req.prompts)) for i in range(req.n)]
    try:
        for chunk in chunks.opening():
            await resp.write(sse_event(chunk))
        running = len(tasks)
        while running:
            p, i, item = await queue.get()
            if isinstance(item, Exception):
                log.error("streamed request failed: %s: %s", type(item).__name__, item)
                await resp.write(
                    sse_event(error_body(f"generation failed: {type(item).__name__}: {item}", "internal_error"))
                )
                break
            for chunk in chunks.update(p, i, item):
                await resp.write(sse_event(chunk))
            running -= item.result is not None
        else:
            for chunk in chunks.closing():
                await resp.write(sse_event(chunk))
        await end_sse(resp)
    except ConnectionResetError:  # the client went away: stop its sequences
        log.info("client disconnected from a streamed request")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return resp


def _check_room(engine: Any, req: ParsedRequest) -> None:
    """EngineBusyError (503) before a request starts when its sequences would overflow the engine's waiting queue."""
    check = getattr(engine, "check_room", None)
    if check is not None:
        check(len(req.prompts) * req.n)


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    req = await _parse(request, parse_completion_request, body)
    _check_room(engine, req)
    if req.stream:
        return await _stream(request, req, body, chat=False)
    if req.prompt_logprobs is None:
        results = await _generate_all(request, req, body)
        return web.json_response(build_completion_response(req, results, engine.tokenizer))
    scored, results = await _score_and_generate(request, req, body)
    return web.json_response(build_completion_response(req, results, engine.tokenizer, scored))


async def _score_and_generate(request: web.Request, req: ParsedRequest, body: Any) -> tuple[list, list[list[Any]]]:
    """``prompt_logprobs``: the engine's scoring forward (no KV cache) beside the generation, at the request's
    ``temperature`` (0, greedy, scores the raw logits); with ``max_tokens: 0`` only the scoring, and every choice is
    empty (``finish_reason`` ``length``)."""
    engine = request.app[ENGINE_KEY]
    t = req.params.temperature
    scoring = asyncio.ensure_future(engine.prompt_logprobs(req.prompts, req.prompt_logprobs, t if t > 0 else 1.0))
    try:
        results = await _generate_all(request, req, body) if req.params.max_tokens > 0 else None
        scored = await scoring
    finally:
        scoring.cancel()
    if results is None:
        results = [
            [
                GenerationResult(
                    prompt_token_ids=list(prompt),
                    output_token_ids=[],
                    output_logprobs=[],
                    finish_reason="length",
                    weight_version=s.weight_version,
                    cached_prompt_tokens=0,
                    text="",
                )
                for _ in range(req.n)
            ]
            for prompt, s in zip(req.prompts, scored)
        ]
    return scored, results


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await read_json(request)
    req = await _parse(request, parse_chat_request, body)
    _check_room(engine, req)
    if req.stream:
        return await _stream(request, req, body, chat=True)
    results = await _generate_all(request, req, body)
    return web.json_response(build_chat_response(req, results[0], engine.tokenizer))


async def models(request: web.Request) -> web.Response:
    engine, settings = request.app[ENGINE_KEY], request.app[SETTINGS_KEY]
    card = {
        "id": settings["served_names"][0],
        "object": "model",
        "created": settings["started"],
        "owned_by": "training",
        "root": engine.model_name,
        "max_model_len": engine.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    """200 ``{"status": "ok", "weight_version"}`` while the engine thread runs; 503 ``{"status": "dead", "reason"}``
    once it has died (the launcher's watchdog then restarts the server)."""
    engine = request.app[ENGINE_KEY]
    if engine.dead_reason is not None:
        return web.json_response({"status": "dead", "reason": engine.dead_reason}, status=503)
    return web.json_response({"status": "ok", "weight_version": engine.weight_version})


async def weight_version(request: web.Request) -> web.Response:
    """The served version and the dtype the weights are held in (a push casts to it before sending)."""
    engine = request.app[ENGINE_KEY]
    dtype = str(engine.engine.dtype).removeprefix("torch.")
    return web.json_response({"weight_version": engine.weight_version, "dtype": dtype})


async def stats(request: web.Request) -> web.Response:
    """The engine's counters and ``pools``: each table's and the process's ``{"size", "bound"}``; ``kernel_caches``:
    the capacity of each of oneDNN's per-shape caches (``kernel_caches.py``)."""
    s = request.app[ENGINE_KEY].stats()
    s["pools"] = {**s.get("pools", {}), **process_pools(), "stored_responses": request.app[RESPONSES_KEY].pool()}
    s["kernel_caches"] = kernel_cache_bounds()
    return web.json_response(s, dumps=lambda o: json.dumps(o, default=str))


async def pause(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].pause()
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "running"})


def server_tool_parser(engine: Any) -> ToolParser:
    """The tool-call parser of this server: ``engine.config.tool_call_parser`` (``auto``: from the chat template,
    ``training/openai_api/tool_parsers/registry.py``), logged once at start-up with why it was chosen."""
    setting = getattr(getattr(engine, "config", None), "tool_call_parser", AUTO)
    parser, why = select_tool_parser(setting, getattr(engine.tokenizer, "chat_template", None))
    log.info(why)
    return parser


def create_app(
    engine: Any,
    *,
    served_model_name: Optional[str] = None,
    api_key: Optional[str] = None,
    manage_engine: bool = True,
    weight_dirs: Optional[list[str]] = None,
    weight_peers: Optional[list[str]] = None,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> web.Application:
    """Build the aiohttp app. ``manage_engine``: start the engine on app startup, shut it down on cleanup.

    Serve it with ``handler_cancellation=True`` (``web.AppRunner`` / ``web.run_app``, as serve.py
    does) so that a non-streamed request whose client disconnects is aborted; streamed requests
    notice a disconnect on their next write either way. Control endpoints are shielded: they
    finish even when their client goes away.

    ``weight_dirs``: the folders ``/update_weights_from_disk`` may read (symlinks resolved; default
    the temp dir, /dev/shm, the working directory and the served model's own folder). ``weight_peers``: the hosts
    ``/init_weight_update_group`` may connect to (default loopback only). ``limits``: the
    per-request limits (``server/limits.py``).
    """
    app = web.Application(middlewares=[_errors_and_auth], client_max_size=MAX_BODY_BYTES)
    app[ENGINE_KEY] = engine
    name = served_model_name or engine.model_name
    model_arg = getattr(getattr(engine, "config", None), "model", engine.model_name)  # the --model value
    aliases = tuple(dict.fromkeys([name, engine.model_name, model_arg]))
    dirs = (
        weight_dirs
        if weight_dirs
        else [
            tempfile.gettempdir(),
            *map(str, shm_roots()),
            os.getcwd(),
            *([model_arg] if isinstance(model_arg, str) and os.path.isdir(model_arg) else []),
        ]
    )
    app[SETTINGS_KEY] = {
        "api_key": api_key,
        "served_names": aliases,
        "started": int(time.time()),
        "weight_dirs": [Path(d).resolve() for d in dirs],
        "weight_peers": list(weight_peers) if weight_peers else list(LOOPBACK_PEERS),
        "limits": limits,
        "tool_parser": server_tool_parser(engine),
        "tokenize_pool": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
    }
    app[DIST_KEY] = {"group": None, "busy": False, "waits": set()}
    app[RESPONSES_KEY] = ResponseStore()
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", chat_completions),
            *responses_routes(),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/weight_version", weight_version),
            web.get("/stats", stats),
            *weight_routes(),
            web.post("/pause", pause),
            web.post("/resume", resume),
            *sleep_routes(),
        ]
    )

    async def _close_group(_app: web.Application) -> None:
        if _app[DIST_KEY]["group"] is not None:
            _app[DIST_KEY]["group"].close()

    app.on_cleanup.append(_close_group)

    async def _cancel_group_waits(_app: web.Application) -> None:  # a join must not hold up a shutdown
        for wait in list(_app[DIST_KEY]["waits"]):
            wait.cancel()

    app.on_shutdown.append(_cancel_group_waits)

    async def _close_tokenizer_thread(app: web.Application) -> None:
        app[SETTINGS_KEY]["tokenize_pool"].shutdown(wait=False, cancel_futures=True)

    app.on_cleanup.append(_close_tokenizer_thread)
    if manage_engine:

        async def _start(_app: web.Application) -> None:
            await engine.start()

        async def _stop(_app: web.Application) -> None:
            await engine.shutdown()

        app.on_startup.append(_start)
        app.on_cleanup.append(_stop)
    return app
