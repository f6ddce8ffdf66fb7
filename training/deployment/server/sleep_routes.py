"""The embedded server's sleep endpoints (vLLM's names and meaning), for colocation on one GPU:

- ``POST /sleep?level=1|2``: finish the running and queued requests, then free the KV cache and the
  weight copies derived for speed (level 1) or the weights too (level 2). Answers the bytes freed.
- ``POST /wake_up``: allocate them again. After level 2 the weights come from the weight push that
  followed the sleep; with no push, from the served model folder again (``weight_version`` 0, logged).
- ``GET /is_sleeping``: ``{"is_sleeping", "level", "sleeps", "wakes", "weight_reloads"}``.

Requests that arrive while the engine sleeps wait (queued) and run after ``/wake_up``; weight pushes
land while asleep. Protected by the API key like ``/pause``.
"""

from __future__ import annotations

from aiohttp import web

from training.deployment.server.protocol import RequestError
from training.deployment.server.context import ENGINE_KEY


def _state(engine) -> dict:
    return {"is_sleeping": engine.sleep_level > 0, "level": engine.sleep_level, **engine.sleep_counts}


async def sleep(request: web.Request) -> web.Response:
    raw = request.query.get("level", "1")
    if raw not in ("1", "2"):
        raise RequestError(f"'level' must be 1 or 2, got {raw!r}", "level")
    engine = request.app[ENGINE_KEY]
    freed = await engine.sleep(int(raw))
    return web.json_response({**_state(engine), "freed": freed})


async def wake_up(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    woke = await engine.wake_up()
    return web.json_response({**_state(engine), **woke, "weight_version": engine.weight_version})


async def is_sleeping(request: web.Request) -> web.Response:
    return web.json_response(_state(request.app[ENGINE_KEY]))


def sleep_routes() -> list[web.RouteDef]:
    return [
        web.post("/sleep", sleep),
        web.post("/wake_up", wake_up),
        web.get("/is_sleeping", is_sleeping),
    ]
