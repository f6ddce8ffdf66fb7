"""The embedded server's weight endpoints: ``/update_weights_from_disk``, ``/update_weights_from_shm``
(a safetensors file, path confined to the allowed folders), and the torch.distributed path
``/init_weight_update_group``, ``/update_weights_from_distributed`` (see server/distributed_receiver.py).

Every file of a pushed folder is resolved with its symlinks and must lie under the allowed folders;
a refusal names the client's path and the rule, never a file's bytes or size; a file whose size or
mtime changes while it is read (``MappedWeights.changed``) refuses the push before the swap.
A refused update gets 400 and the old weights stay live; a version below the served one is refused
(409) unless forced; a streamed update that fails half-way answers 500 and leaves ``weight_version = -1``.
"""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from aiohttp import web

from training.deployment.engine.requests import PartialWeightUpdateError
from training.deployment.server.protocol import RequestError
from training.openai_api.errors import error_response
from training.deployment.server.limits import check_weight_path
from training.deployment.server.context import ENGINE_KEY, SETTINGS_KEY, read_json
from training.utils.openmp import releasing_openmp_threads

DIST_KEY = web.AppKey("dist_weights", dict)
"""The torch.distributed weight-update state: ``group`` (or None), ``busy`` (a join or update runs) and
``waits`` (the blocking joins / store waits in flight, cancelled at shutdown)."""

LOOPBACK_PEERS = ("127.0.0.1", "localhost", "::1")
"""Hosts ``/init_weight_update_group`` may connect to unless the server was given others."""


def shm_roots() -> list[Path]:
    """Folders a ``/update_weights_from_shm`` file may live in: /dev/shm, else the temp dir."""
    shm = Path("/dev/shm")
    return [shm.resolve()] if shm.is_dir() else [Path(tempfile.gettempdir()).resolve()]


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
def _finite_tensors(tensors: Mapping) -> Mapping:
    """Refuse NaN or inf weights (400 naming the first such tensor); they would poison every answer."""
    import torch

    for name, t in tensors.items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise RequestError(f"tensor {name!r} holds NaN or inf values; the served weights are unchanged", "path")
    return tensors


def _confined_files(path: Path, shown: str, roots: list[Path]) -> list[Path]:
    """The ``*.safetensors`` files of ``path`` (a file, or a folder's), each with its symlinks resolved; a file
    that resolves outside ``roots`` refuses the push, naming the client's path and the rule."""
    from training.deployment.engine.weights import safetensors_files

    try:
        files = safetensors_files(path)
    except FileNotFoundError:
        raise RequestError(f"no *.safetensors file in {shown!r}", "path") from None
    resolved = []
    for f in files:
        try:
            r = f.resolve(strict=True)
        except (OSError, RuntimeError):
            raise RequestError(f"'path' {shown!r}: {f.name} cannot be resolved on the server", "path") from None
        if not any(r.is_relative_to(root) for root in roots):
            raise RequestError(
                f"'path' {shown!r}: {f.name} resolves outside the server's weight folders (every file of a push, "
                "its symlinks resolved, must lie under them; set them with --weight-dir)",
                "path",
            )
        resolved.append(r)
    return resolved


@releasing_openmp_threads
def _read_weights(files: list[Path]) -> Mapping:
    """Every tensor of the safetensors ``files`` (never pickle), as views on the files (``MappedWeights``:
    checking and loading them keeps a few tensors of the files resident)."""
    from training.deployment.engine.weights import MappedWeights

    return MappedWeights(files)


def _read_error(e: Exception, path: Path, shown: str) -> str:
    """What a refusal says of a file that could not be read: ``WeightFileError``'s own message (which never
    quotes the file's bytes or size) or the OS error, with the client's path; never another exception's text."""
    from training.deployment.engine.weights import WeightFileError

    if isinstance(e, WeightFileError):
        detail = str(e)
    elif isinstance(e, OSError):
        detail = e.strerror or "unreadable"
    else:
        detail = "not a readable safetensors file"
    return f"{type(e).__name__}: {detail}".replace(str(path), shown)  # the client's own path, never the resolved one


async def _load_checked(path: Path, shown: str, roots: list[Path]) -> tuple[Mapping, float]:
    """The checked tensors of a push: every file confined to ``roots``, read, finite, and unchanged (size and
    mtime) from before the read to after it, else a refusal with the served weights unchanged."""
    t0 = time.perf_counter()
    files = _confined_files(path, shown, roots)
    try:
        tensors = await asyncio.to_thread(_read_weights, files)
    except Exception as e:  # a file that is not safetensors, truncated, unreadable: the client's mistake
        detail = _read_error(e, path, shown)
        raise RequestError(f"could not read safetensors weights at {shown!r}: {detail}", "path") from e
    if not tensors:
        raise RequestError(f"no safetensors tensors at {shown!r}", "path")
    tensors = await asyncio.to_thread(_finite_tensors, tensors)
    changed = tensors.changed()
    if changed:
        names = ", ".join(f.name for f in changed)
        raise RequestError(
            f"'path' {shown!r}: {names} changed (size or mtime) while the server read it; the served weights "
            "are unchanged",
            "path",
        )
    return tensors, time.perf_counter() - t0


async def update_weights_from_disk(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path, version, wait = _update_fields(request, await read_json(request))
    resolved = _confined(path, request.app[SETTINGS_KEY]["weight_dirs"])
    if not _is_file(resolved, folder_ok=True):
        raise RequestError(f"'path' {path!r} does not exist on the server", "path")
    t0 = time.perf_counter()
    tensors, read_s = await _load_checked(resolved, path, request.app[SETTINGS_KEY]["weight_dirs"])
    await engine.update_weights(tensors, version, wait_for_inflight=wait)
    return web.json_response(
        {"weight_version": engine.weight_version, "read_s": read_s, "load_s": time.perf_counter() - t0}
    )


async def update_weights_from_shm(request: web.Request) -> web.Response:
    engine = request.app[ENGINE_KEY]
    path, version, wait = _update_fields(request, await read_json(request))
    resolved = _confined(path, shm_roots())
    if not _is_file(resolved, folder_ok=False) or resolved.suffix != ".safetensors":
        raise RequestError(f"'path' {path!r} is not an existing .safetensors file", "path")
    t0 = time.perf_counter()
    tensors, read_s = await _load_checked(resolved, path, shm_roots())
    await engine.update_weights(tensors, version, wait_for_inflight=wait)
    return web.json_response(
        {"weight_version": engine.weight_version, "read_s": read_s, "load_s": time.perf_counter() - t0}
    )


async def init_weight_update_group(request: web.Request) -> web.Response:
    """Join the trainer's weight-update group (rank >= 1); replaces any previous group."""
    from training.deployment.server.distributed_receiver import WeightUpdateGroup, in_daemon_thread, parse_group_body

    spec = parse_group_body(await read_json(request), request.app[SETTINGS_KEY]["limits"])
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
    from training.deployment.server.distributed_receiver import in_daemon_thread, parse_update_body

    engine, state = request.app[ENGINE_KEY], request.app[DIST_KEY]
    runner = engine.engine.runner
    plan = parse_update_body(await read_json(request), runner.weight_shapes, runner.tied)
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


def weight_routes() -> list[web.RouteDef]:
    return [
        web.post("/update_weights_from_disk", update_weights_from_disk),
        web.post("/update_weights_from_shm", update_weights_from_shm),
        web.post("/init_weight_update_group", init_weight_update_group),
        web.post("/update_weights_from_distributed", update_weights_from_distributed),
    ]
