"""Run the deployment server: ``python -m training.deployment.serve --model DIR --port 8000``.

Engine settings are ``EngineConfig`` fields, as flags (``--max-batch-size 16``) or all at once as
``--engine-config JSON`` (the launcher passes the config whole this way).

Loads the model into an ``AsyncEngine``, serves the OpenAI-compatible app from ``server/app.py``
on 127.0.0.1 (default), prints one ready line once requests can be served::

    DEPLOYMENT READY http://127.0.0.1:8000 model=<name> weight_version=0

and shuts down cleanly (stop accepting, finish the engine) on SIGTERM or SIGINT. With
``--exit-with-parent PID`` it also shuts down when that process goes away (the launcher's
guard against orphaned servers after a ``kill -9`` of the trainer).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from typing import Optional

from aiohttp import web

from training.deployment.server.kernel_caches import bound_kernel_caches
from training.deployment.server.limits import RequestLimits
from training.utils.cli import OverrideError, field_docs, field_types, parse_value
from training.utils.config import EngineConfig
from training.utils.http import IDLE_CONNECTION_TIMEOUT_S, close_idle_connections

READY_PREFIX = "DEPLOYMENT READY"
SHUTDOWN_DEADLINE_S = 20.0
"""After SIGTERM / SIGINT the process exits within this long, even if a weight-group join or an
engine step is still blocked (it is then ended with exit status 1)."""


def build_parser() -> argparse.ArgumentParser:
    """Server flags, then one flag per ``EngineConfig`` field (``--max-batch-size 16``...), generated
    from the dataclass: its annotation converts the value, its docstring is the help."""
    p = argparse.ArgumentParser(prog="python -m training.deployment.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port, printed in the ready line)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("DEPLOYMENT_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $DEPLOYMENT_API_KEY; unset = no auth)",
    )
    p.add_argument(
        "--allow-open-bind",
        action="store_true",
        help="start on a --host other than loopback without an API key (anyone who reaches the port "
        "can then pause the server and load weights into it)",
    )
    p.add_argument(
        "--weight-dir",
        action="append",
        default=None,
        metavar="DIR",
        help="a folder /update_weights_from_disk may read (repeat for several; symlinks are resolved "
        "and must stay inside; default: the temp dir, /dev/shm, the working directory and the model folder)",
    )
    p.add_argument(
        "--weight-peer",
        action="append",
        default=None,
        metavar="HOST",
        help="a host /init_weight_update_group may connect to (repeat; default: loopback only)",
    )
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument(
        "--exit-with-parent",
        type=int,
        default=None,
        metavar="PID",
        help="shut down when process PID is no longer this server's parent",
    )
    p.add_argument(
        "--idle-timeout-s",
        type=float,
        default=IDLE_CONNECTION_TIMEOUT_S,
        help="close a connection that has had no request in progress (incomplete headers, or idle keep-alive) "
        "for this many seconds",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="concurrent connections served; more get a 503 with Retry-After (GET /health still answers) "
        "(default: the file-descriptor limit less 256, at most 4096)",
    )
    p.add_argument("--log-level", default="INFO")
    p.add_argument(
        "--engine-config",
        default=None,
        metavar="JSON",
        help="every EngineConfig field as one JSON object (what the launcher passes); "
        "the flags below override its values",
    )
    engine = p.add_argument_group("engine settings (EngineConfig)")
    docs, types_ = field_docs(EngineConfig), field_types(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        engine.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=argparse.SUPPRESS,
            type=functools.partial(_flag_value, annotation=types_[f.name], name=f.name),
            help=f"{docs.get(f.name, '')} (default {f.default!r})"
            if f.default is not dataclasses.MISSING
            else docs.get(f.name, ""),
        )
    limits = p.add_argument_group("per-request limits (RequestLimits; a 400 naming the limit above them)")
    docs, types_ = field_docs(RequestLimits), field_types(RequestLimits)
    for f in dataclasses.fields(RequestLimits):
        limits.add_argument(
            f"--{f.name.replace('_', '-')}",
            dest=f.name,
            default=f.default,
            type=functools.partial(_flag_value, annotation=types_[f.name], name=f.name),
            help=f"{docs.get(f.name, '')} (default {f.default!r})",
        )
    return p


def request_limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """The ``RequestLimits`` the flags give."""
    try:
        return RequestLimits(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RequestLimits)})
    except ValueError as e:
        raise SystemExit(f"request limits: {e}") from None


def _flag_value(raw: str, annotation, name: str):
    try:
        return parse_value(raw, annotation, "--" + name.replace("_", "-"))
    except OverrideError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """``--engine-config`` (if given) with the individual engine flags applied over it."""
    base = {}
    if args.engine_config:
        try:
            base = json.loads(args.engine_config)
        except json.JSONDecodeError as e:
            raise SystemExit(f"--engine-config: not valid JSON: {e}") from None
        if not isinstance(base, dict):
            raise SystemExit("--engine-config: must be a JSON object of EngineConfig fields")
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    unknown = sorted(set(base) - names)
    if unknown:
        raise SystemExit(f"--engine-config: unknown field {unknown[0]!r}; EngineConfig has {sorted(names)}")
    base.update({k: v for k, v in vars(args).items() if k in names})
    if isinstance(base.get("cuda_graph_batch_sizes"), list):
        base["cuda_graph_batch_sizes"] = tuple(base["cuda_graph_batch_sizes"])
    if not base.get("model"):
        raise SystemExit('--model is required (or a "model" in --engine-config)')
    try:
        return EngineConfig(**base)
    except ValueError as e:
        raise SystemExit(f"engine settings: {e}") from None


async def _watch_parent(parent_pid: int, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logging.getLogger(__name__).warning("parent %d is gone: shutting down", parent_pid)
            stop.set()
            return
        await asyncio.sleep(interval_s)


async def serve(args: argparse.Namespace, ready_file: Optional[object] = None) -> None:
    """Start engine and HTTP server, print the ready line, run until a stop signal."""
    from training.deployment.server.connection_limit import CappedTCPSite, default_max_connections
    from training.deployment.engine import AsyncEngine
    from training.deployment.server.app import create_app

    engine = AsyncEngine(engine_config_from_args(args))
    await engine.start()
    app = create_app(
        engine,
        served_model_name=args.served_model_name,
        api_key=args.api_key,
        manage_engine=False,
        weight_dirs=args.weight_dir,
        weight_peers=args.weight_peer,
        limits=request_limits_from_args(args),
    )
    # handler_cancellation: a client that disconnects cancels its handler, which aborts its sequences
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0, handler_cancellation=True)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = reaper = None
    try:
        site = CappedTCPSite(
            runner,
            args.host,
            args.port,
            max_connections=args.max_connections or default_max_connections(),
            health=lambda: {"status": "ok", "weight_version": engine.weight_version},
        )
        await site.start()
        port = site.bound_port
        name = args.served_model_name or engine.model_name
        if engine.engine.device.type == "cuda":  # the recipe's engine="auto" picks vLLM where it is installed
            print(
                f"deployment server: the embedded engine on {engine.engine.device} is the small-model path (its decode "
                "is simple); for larger models on GPUs use vLLM (deployment.engine=vllm, README 'GPU quickstart')",
                flush=True,
            )
        print(
            f"{READY_PREFIX} http://{args.host}:{port} model={name} weight_version={engine.weight_version}",
            file=ready_file or sys.stdout,
            flush=True,
        )
        reaper = asyncio.create_task(close_idle_connections(runner.server, args.idle_timeout_s))
        if args.exit_with_parent is not None:
            watcher = asyncio.create_task(_watch_parent(args.exit_with_parent, stop))
        await stop.wait()
    finally:
        deadline = threading.Timer(SHUTDOWN_DEADLINE_S, _exit_now)  # never cancelled (see below)
        deadline.daemon = True
        deadline.start()
        for task in (watcher, reaper):
            if task is not None:
                task.cancel()
        await runner.cleanup()
        await engine.shutdown()
        print("deployment server stopped", flush=True)
        # the daemon timer keeps running: it also bounds the interpreter's own exit (thread joins, atexit)


def _exit_now() -> None:
    """The shutdown deadline passed: end the process (a blocked thread cannot hold it up)."""
    print(f"deployment server: shutdown took over {SHUTDOWN_DEADLINE_S:g} s; exiting now", file=sys.stderr, flush=True)
    os._exit(1)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (127.0.0.0/8 or ::1), judged by address,
    never by name: ``127.attacker.example`` is whatever its DNS says. A host that does not resolve is not."""
    try:
        infos = socket.getaddrinfo(host, None)
    except (OSError, UnicodeError):
        return False
    addresses = {ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos}
    return bool(addresses) and all(a.is_loopback for a in addresses)


def check_bind(args: argparse.Namespace) -> None:
    """Refuse a non-loopback ``--host`` (``is_loopback``: by its resolved addresses) without ``--api-key``
    unless ``--allow-open-bind`` says it is meant."""
    if args.api_key or is_loopback(args.host):
        return
    if not args.allow_open_bind:
        raise SystemExit(
            f"--host {args.host}: binding beyond this host without --api-key lets anyone who reaches "
            "the port pause the server and load weights into it; set --api-key (or "
            "$DEPLOYMENT_API_KEY), or pass --allow-open-bind if this network is trusted"
        )
    logging.getLogger(__name__).warning("serving on %s without an API key (--allow-open-bind)", args.host)


def main(argv: Optional[list[str]] = None) -> None:
    bound_kernel_caches()  # before torch's first matmul: oneDNN's per-shape caches hold ~0.5 MB a shape
    args = build_parser().parse_args(argv)
    engine_config_from_args(args)  # a bad setting stops here, before logging and model loading
    check_bind(args)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
