"""aiohttp application over an ``AsyncEngine``: OpenAI-compatible endpoints + weight control.

Endpoints (see README.md for bodies):

- ``POST /v1/completions``, ``POST /v1/chat/completions``: generation, token-level detail on request.
- ``GET /v1/models``, ``GET /health`` (never needs the API key), ``GET /weight_version``, ``GET /stats``.
- ``POST /update_weights_from_disk``, ``POST /update_weights_from_shm``, ``POST /pause``, ``POST /resume``.
- ``POST /init_weight_update_group``, ``POST /update_weights_from_distributed``: the torch.distributed
  path (the trainer broadcasts tensors; see ``dist_weights.py``, ``dist_weights_receiver.py``).

Contract: a bad request gets 400 with the OpenAI error envelope naming the field and never
disturbs other requests; a refused weight update gets 400 and the old weights stay live;
every generation response carries ``weight_version``.
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

from training.deployment.engine.config import (
    EngineError,
    PartialWeightUpdateError,
    SequenceFailedError,
    WeightUpdateError,
)
from training.deployment.protocol import (
    ParsedRequest,
    RequestError,
    parse_chat_request,
    parse_completion_request,
)
from training.deployment.request_limits import DEFAULT_LIMITS, RequestLimits, check_weight_path
from training.deployment.responses import build_chat_response, build_completion_response
from training.deployment.streaming import ChunkStream
from training.utils.http import JsonBodyError, bearer_ok, parse_json_body, session_id_of
from training.utils.openai_errors import error_body, error_response
from training.utils.openmp import releasing_openmp_threads
from training.utils.sse import end_sse, open_sse, sse_event

log = logging.getLogger(__name__)

ENGINE_KEY = web.AppKey("engine", object)
SETTINGS_KEY = web.AppKey("settings", dict)
DIST_KEY = web.AppKey("dist_weights", dict)
"""The torch.distributed weight-update state: ``group`` (or None), ``busy`` (a join or update runs) and
``waits`` (the blocking joins / store waits in flight, cancelled at shutdown)."""
_OPEN_PATHS = ("/health",)
"""Paths that never require the API key."""


LOOPBACK_PEERS = ("127.0.0.1", "localhost", "::1")
"""Hosts ``/init_weight_update_group`` may connect to unless the server was given others."""


def shm_roots() -> list[Path]:
    """Folders a ``/update_weights_from_shm`` file may live in: /dev/shm, else the temp dir."""
    shm = Path("/dev/shm")
    return [shm.resolve()] if shm.is_dir() else [Path(tempfile.gettempdir()).resolve()]


_CANCEL_ON_DISCONNECT = frozenset({"/v1/completions", "/v1/chat/completions"})
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


BODY_READ_TIMEOUT_S = 60.0
"""A client must deliver its request body within this long (408 otherwise; a stalled upload holds a slot)."""
MAX_BODY_BYTES = 32 * 1024 * 1024
"""Largest request body (413 above it)."""


async def _read_json(request: web.Request) -> Any:
    try:
        raw = await asyncio.wait_for(request.read(), BODY_READ_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RequestError(f"the request body did not arrive within {BODY_READ_TIMEOUT_S:g} s", status=408) from None
    try:
        return parse_json_body(raw)
    except JsonBodyError as e:
        raise RequestError(str(e), e.param) from e


async def _parse(request: web.Request, parse: Callable[..., ParsedRequest], body: Any) -> ParsedRequest:
    """Validate and tokenize (or render the chat template) in the app's one tokenizer thread, off the event
    loop: a long prompt no longer stalls /health and every other request (one thread: HF tokenizers are
    not safe to call concurrently)."""
    pool = request.app[SETTINGS_KEY]["tokenize_pool"]
    names, limits = request.app[SETTINGS_KEY]["served_names"], request.app[SETTINGS_KEY]["limits"]
    return await asyncio.get_running_loop().run_in_executor(pool, parse, body, request.app[ENGINE_KEY], names, limits)


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


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    req = await _parse(request, parse_completion_request, body)
    if req.stream:
        return await _stream(request, req, body, chat=False)
    results = await _generate_all(request, req, body)
    return web.json_response(build_completion_response(req, results, engine.tokenizer))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    body = await _read_json(request)
    req = await _parse(request, parse_chat_request, body)
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
    return web.json_response({"status": "ok", "weight_version": request.app[ENGINE_KEY].weight_version})


async def weight_version(request: web.Request) -> web.Response:
    return web.json_response({"weight_version": request.app[ENGINE_KEY].weight_version})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].stats(), dumps=lambda o: json.dumps(o, default=str))


def _update_fields(request: web.Request, body: Any) -> tuple[str, int, bool]:
    """``path``, ``weight_version``, ``wait_for_inflight`` of a weight push. A version below the one
    served is refused (409) unless ``force`` is true: a stale trainer must not roll weights back."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    path, version = check_weight_path(body.get("path")), body.get("weight_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RequestError(f"'weight_version' must be an integer, got {version!r}", "weight_version")
    wait = body.get("wait_for_inflight", True)
    if not isinstance(wait, bool):
        raise RequestError("'wait_for_inflight' must be a boolean", "wait_for_inflight")
    force = body.get("force", False)
    if not isinstance(force, bool):
        raise RequestError("'force' must be a boolean", "force")
    served = request.app[ENGINE_KEY].weight_version
    if version < served and not force:
        raise RequestError(
            f"'weight_version' {version} is older than the served {served}; send \"force\": true "
            "to roll back on purpose",
            "weight_version",
            status=409,
        )
    return path, version, wait


def _confined(path: str, roots: list[Path]) -> Path:
    """``path`` with symlinks resolved, if it lies under one of ``roots``; the error never says
    whether a path outside them exists, nor names a folder of the server."""
    try:
        resolved = Path(path).resolve()
    except (OSError, ValueError, RuntimeError):  # a symlink loop, an unreadable component...
        raise RequestError("'path' cannot be resolved on the server", "path") from None
    if not any(resolved.is_relative_to(r) for r in roots):
        raise RequestError("'path' is not under the server's weight folders (set them with --weight-dir)", "path")
    return resolved


def _is_file(path: Path, *, folder_ok: bool) -> bool:
    try:
        return path.is_file() or (folder_ok and path.is_dir())
    except OSError:
        return False


@releasing_openmp_threads
def _finite_tensors(tensors: dict) -> dict:
    """Refuse NaN or inf weights (400 naming the first such tensor); they would poison every answer."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RequestError(f"tensor {name!r} holds NaN or inf values; the served weights are unchanged", "path")
    return tensors


@releasing_openmp_threads
def _read_weights(path: Path) -> dict:
    """Every tensor of a safetensors file, or of the ``*.safetensors`` files of a folder (never pickle)."""
    from training.deployment.engine.weights import load_safetensors

    return load_safetensors(str(path))


async def _load_checked(path: Path, shown: str) -> tuple[dict, float]:
    t0 = time.perf_counter()
    try:
        tensors = await asyncio.to_thread(_read_weights, path)
    except Exception as e:  # a file that is not safetensors, truncated, unreadable: the client's mistake
        detail = str(e).replace(str(path), shown)  # the client's own path, never the resolved one
        raise RequestError(
            f"could not read safetensors weights at {shown!r}: {type(e).__name__}: {detail}", "path"
        ) from e
    if not tensors:
        raise RequestError(f"no safetensors tensors at {shown!r}", "path")
    return await asyncio.to_thread(_finite_tensors, tensors), time.perf_counter() - t0


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path, version, wait = _update_fields(request, await _read_json(request))
    resolved = _confined(path, request.app[SETTINGS_KEY]["weight_dirs"])
    if not _is_file(resolved, folder_ok=True):
        raise RequestError(f"'path' {path!r} does not exist on the server", "path")
    t0 = time.perf_counter()
    tensors, read_s = await _load_checked(resolved, path)
    await engine.update_weights(tensors, version, wait_for_inflight=wait)
    return web.json_response(
        {"weight_version": engine.weight_version, "read_s": read_s, "load_s": time.perf_counter() - t0}
    )


async def update_weights_from_shm(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path, version, wait = _update_fields(request, await _read_json(request))
    resolved = _confined(path, shm_roots())
    if not _is_file(resolved, folder_ok=False) or resolved.suffix != ".safetensors":
        raise RequestError(f"'path' {path!r} is not an existing .safetensors file", "path")
    t0 = time.perf_counter()
    tensors, read_s = await _load_checked(resolved, path)
    await engine.update_weights(tensors, version, wait_for_inflight=wait)
    return web.json_response(
        {"weight_version": engine.weight_version, "read_s": read_s, "load_s": time.perf_counter() - t0}
    )


async def init_weight_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight-update group (rank >= 1); replaces any previous group."""
    from training.deployment.dist_weights_receiver import WeightUpdateGroup, in_daemon_thread, parse_group_body

    spec = parse_group_body(await _read_json(request), request.app[SETTINGS_KEY]["limits"])
    peers = request.app[SETTINGS_KEY]["weight_peers"]
    if spec.master_addr not in peers:
        raise RequestError(
            f"'master_addr' {spec.master_addr!r} is not an allowed weight peer ({', '.join(peers)}; "
            "start the server with --weight-peer HOST to allow it)",
            "master_addr",
            status=403,
        )
    device = request.app[ENGINE_KEY].engine.device
    if spec.backend == "nccl" and device.type != "cuda":
        raise RequestError(
            f"'backend' nccl needs the engine on CUDA; this engine runs on {device}: use gloo", "backend"
        )
    state = request.app[DIST_KEY]
    if state["busy"]:
        raise RequestError("a weight-update group join or update is in progress", status=409)
    state["busy"] = True
    try:
        if state["group"] is not None:
            state["group"].close()
            state["group"] = None
        group = WeightUpdateGroup(spec)
        t0 = time.perf_counter()
        try:
            # blocks until every rank joined (the loop keeps serving); gives up after the body's timeout_s
            # a daemon thread: a join still blocked at shutdown never holds up the process's exit
            await asyncio.wait_for(in_daemon_thread(group.join, pending=state["waits"]), spec.timeout_s)
        except Exception as e:
            group.close()
            reason = (
                f"not every rank joined within timeout_s={spec.timeout_s:g}"
                if isinstance(e, asyncio.TimeoutError)
                else f"{type(e).__name__}: {e}"
            )
            raise RequestError(
                f"could not join the weight-update group at {spec.master_addr}:"
                f"{spec.master_port} as rank {spec.rank}/{spec.world_size}: {reason}",
                "master_addr",
                status=503,
            ) from e
        state["group"] = group
    finally:
        state["busy"] = False
    return web.json_response(
        {
            "status": "joined",
            "rank": spec.rank,
            "world_size": spec.world_size,
            "backend": spec.backend,
            "join_s": time.perf_counter() - t0,
        }
    )


async def update_weights_from_distributed(request: web.Request) -> web.Response:
    """Validate the metadata, wait for the trainer's go, receive the tensors into the engine."""
    from training.deployment.dist_weights_receiver import in_daemon_thread, parse_update_body

    engine, state = request.app[ENGINE_KEY], request.app[DIST_KEY]
    runner = engine.engine.runner
    plan = parse_update_body(await _read_json(request), runner.weight_shapes, runner.tied)
    group = state["group"]
    if group is None:
        raise RequestError("no weight-update group: POST /init_weight_update_group first")
    if state["busy"]:
        raise RequestError("a weight-update group join or update is in progress", status=409)
    state["busy"] = True
    try:
        try:
            go = await in_daemon_thread(group.accept_and_wait_go, plan.update_id, pending=state["waits"])
        except Exception as e:
            raise RequestError(
                f"lost the trainer before the transfer started (old weights kept): {e}", status=503
            ) from e
        if not go:
            raise RequestError(
                "the trainer aborted this update (another server refused it); old weights kept", status=409
            )
        t0, stats = time.perf_counter(), {}
        loader = group.make_loader(plan, runner.targets, stats)
        try:
            await engine.update_weights_streamed(loader, plan.weight_version, wait_for_inflight=plan.wait_for_inflight)
        except PartialWeightUpdateError as e:
            return error_response(
                500,
                f"weight update failed half-way; weights are a mix, weight_version is {engine.weight_version}: {e}",
                "internal_error",
            )
    finally:
        state["busy"] = False
    return web.json_response({"weight_version": engine.weight_version, "load_s": time.perf_counter() - t0, **stats})


async def pause(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].pause()
    return web.json_response({"status": "paused"})


async def resume(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].resume()
    return web.json_response({"status": "running"})


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
    per-request limits (``request_limits.py``).
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
        "tokenize_pool": concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tokenize"),
    }
    app[DIST_KEY] = {"group": None, "busy": False, "waits": set()}
    app.add_routes(
        [
            web.post("/v1/completions", completions),
            web.post("/v1/chat/completions", chat_completions),
            web.get("/v1/models", models),
            web.get("/health", health),
            web.get("/weight_version", weight_version),
            web.get("/stats", stats),
            web.post("/update_weights_from_disk", update_weights_from_disk),
            web.post("/update_weights_from_shm", update_weights_from_shm),
            web.post("/init_weight_update_group", init_weight_update_group),
            web.post("/update_weights_from_distributed", update_weights_from_distributed),
            web.post("/pause", pause),
            web.post("/resume", resume),
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
