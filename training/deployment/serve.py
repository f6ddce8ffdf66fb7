"""Run the deployment server: ``python -m training.deployment.serve --model DIR --port 8000``.

Loads the model into an ``AsyncEngine``, serves the OpenAI-compatible app from ``server.py``
on 127.0.0.1 (default), prints one ready line once requests can be served::

    DEPLOYMENT READY http://127.0.0.1:8000 model=<name> weight_version=0

and shuts down cleanly (stop accepting, finish the engine) on SIGTERM or SIGINT. With
``--exit-with-parent PID`` it also shuts down when that process goes away (the launcher's
guard against orphaned servers after a ``kill -9`` of the trainer).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Optional

from aiohttp import web

READY_PREFIX = "DEPLOYMENT READY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.deployment.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face folder or hub id")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1: this host only)")
    p.add_argument("--port", type=int, default=8000, help="port to bind (0 = any free port, printed in the ready line)")
    p.add_argument("--api-key", default=os.environ.get("DEPLOYMENT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $DEPLOYMENT_API_KEY; unset = no auth)")
    p.add_argument("--served-model-name", default=None, help="name reported by /v1/models (default: --model)")
    p.add_argument("--max-batch-size", type=int, default=64, help="sequences decoded at once (KV cache slots)")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest prompt + completion, in tokens")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed for requests that bring none")
    p.add_argument("--no-prefix-caching", action="store_true", help="reuse K/V across requests only by session id")
    p.add_argument("--prefix-cache-slots", type=int, default=0,
                   help="KV slots beyond --max-batch-size that only hold cached prefixes")
    p.add_argument("--inflight-update-kv", default="keep", choices=["keep", "recompute"],
                   help="K/V of running sequences at a wait_for_inflight=false weight update")
    p.add_argument("--exit-with-parent", type=int, default=None, metavar="PID",
                   help="shut down when process PID is no longer this server's parent")
    p.add_argument("--log-level", default="INFO")
    return p


async def _watch_parent(parent_pid: int, stop: asyncio.Event, interval_s: float = 1.0) -> None:
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logging.getLogger(__name__).warning("parent %d is gone: shutting down", parent_pid)
            stop.set()
            return
        await asyncio.sleep(interval_s)


async def serve(args: argparse.Namespace, ready_file: Optional[object] = None) -> None:
    """Start engine and HTTP server, print the ready line, run until a stop signal."""
    from training.deployment.engine import AsyncEngine, EngineConfig
    from training.deployment.server import create_app

    engine = AsyncEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                      max_batch_size=args.max_batch_size, max_model_len=args.max_model_len,
                                      seed=args.seed, enable_prefix_caching=not args.no_prefix_caching,
                                      prefix_cache_slots=args.prefix_cache_slots,
                                      inflight_update_kv=args.inflight_update_kv))
    await engine.start()
    app = create_app(engine, served_model_name=args.served_model_name, api_key=args.api_key, manage_engine=False)
    runner = web.AppRunner(app, access_log=None, handle_signals=False, shutdown_timeout=5.0)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    watcher = None
    try:
        site = web.TCPSite(runner, args.host, args.port, reuse_address=True)
        await site.start()
        port = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else args.port
        name = args.served_model_name or engine.model_name
        print(f"{READY_PREFIX} http://{args.host}:{port} model={name} weight_version={engine.weight_version}",
              file=ready_file or sys.stdout, flush=True)
        if args.exit_with_parent is not None:
            watcher = asyncio.create_task(_watch_parent(args.exit_with_parent, stop))
        await stop.wait()
    finally:
        if watcher is not None:
            watcher.cancel()
        await runner.cleanup()
        await engine.shutdown()
        print("deployment server stopped", flush=True)


def main(argv: Optional[list[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
