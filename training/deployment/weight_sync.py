"""Push trainer weights to running deployment servers without restarting them.

Two paths, both safetensors (never pickle):

- ``shm`` (same host, the default): write one file to /dev/shm (or the temp dir where there is
  no /dev/shm), POST ``/update_weights_from_shm``; the server memory-maps and loads it; the file
  is removed afterwards unless ``keep_file`` (the launcher keeps the latest to reload after a
  restart).
- ``disk``: write ``<directory>/model.safetensors`` and POST ``/update_weights_from_disk`` with
  the folder (any host that sees the folder).

``push_weights_to_all`` writes once, pushes to every server concurrently and returns only when
each server reports the new version; it raises ``WeightSyncError`` naming the server that
refused (the refusing server keeps its old weights).
"""

from __future__ import annotations

import asyncio
import json
import os
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterable, Optional, Sequence

import aiohttp
import torch

SHM_DIR = Path("/dev/shm")


class WeightSyncError(RuntimeError):
    """A server refused or failed a weight update."""


def shm_dir() -> Path:
    """Where shm-mode files go: /dev/shm, else the temp dir (the server accepts the same roots)."""
    return SHM_DIR if SHM_DIR.is_dir() else Path(tempfile.gettempdir())


def write_safetensors(named_weights: Iterable[tuple[str, torch.Tensor]], path: str | os.PathLike) -> int:
    """Write tensors to ``path`` (CPU, contiguous; tied tensors copied apart). Returns bytes written."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    seen_storage: set[int] = set()
    for name, t in named_weights:
        if name in tensors:
            raise ValueError(f"named_weights: duplicate tensor name {name!r}")
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage:  # safetensors refuses shared storage (tied embeddings)
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        tensors[name] = t
    if not tensors:
        raise ValueError("named_weights: no tensors given")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    save_file(tensors, str(tmp))
    os.replace(tmp, path)
    return path.stat().st_size


async def _post(session: aiohttp.ClientSession, url: str, body: dict, api_key: Optional[str]) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.post(url, json=body, headers=headers) as resp:
        text = await resp.text()
        if resp.status >= 400:
            raise WeightSyncError(f"{url}: HTTP {resp.status}: {text[:2000]}")
        return json.loads(text)


async def _get_version(session: aiohttp.ClientSession, base_url: str, api_key: Optional[str]) -> int:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with session.get(f"{base_url}/weight_version", headers=headers) as resp:
        if resp.status >= 400:
            raise WeightSyncError(f"{base_url}/weight_version: HTTP {resp.status}: {(await resp.text())[:500]}")
        return int((await resp.json())["weight_version"])


async def push_weights_to_all(base_urls: Sequence[str], named_weights: Iterable[tuple[str, torch.Tensor]],
                              weight_version: int, *, mode: str = "shm", directory: Optional[str] = None,
                              api_key: Optional[str] = None, wait_for_inflight: bool = True,
                              keep_file: bool = False, timeout_s: float = 600.0) -> dict:
    """Write the weights once and load them into every server; return timings and the file path.

    Returns ``{"path", "bytes", "write_s", "load_s", "total_s", "servers": {url: answer}}``;
    ``load_s`` is the slowest server's request time. ``path`` is None once the shm file is removed.
    """
    if mode not in ("shm", "disk"):
        raise ValueError(f"mode: {mode!r} is not one of ('shm', 'disk')")
    if mode == "disk" and not directory:
        raise ValueError("directory: required with mode='disk'")
    if not base_urls:
        raise ValueError("base_urls: at least one server is needed")
    urls = [u.rstrip("/") for u in base_urls]
    t0 = time.perf_counter()
    if mode == "shm":
        path = shm_dir() / f"training-weights-{os.getpid()}-v{weight_version}-{uuid.uuid4().hex[:8]}.safetensors"
        endpoint, sent_path = "/update_weights_from_shm", str(path)
    else:
        Path(directory).mkdir(parents=True, exist_ok=True)
        path = Path(directory) / "model.safetensors"
        endpoint, sent_path = "/update_weights_from_disk", str(Path(directory).resolve())
    written = await asyncio.to_thread(write_safetensors, named_weights, path)
    t1 = time.perf_counter()
    body = {"path": sent_path, "weight_version": weight_version, "wait_for_inflight": wait_for_inflight}
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
            answers = await asyncio.gather(*[_post(session, u + endpoint, body, api_key) for u in urls])
            versions = await asyncio.gather(*[_get_version(session, u, api_key) for u in urls])
        for u, v in zip(urls, versions):
            if v != weight_version:
                raise WeightSyncError(f"{u}: reports weight_version {v} after loading {weight_version}")
    finally:
        if mode == "shm" and not keep_file:
            path.unlink(missing_ok=True)
    t2 = time.perf_counter()
    kept = mode == "disk" or keep_file
    return {"path": str(path) if kept else None, "bytes": written, "write_s": t1 - t0, "load_s": t2 - t1,
            "total_s": t2 - t0, "servers": dict(zip(urls, answers))}


async def push_weights(base_url: str, named_weights: Iterable[tuple[str, torch.Tensor]], weight_version: int, *,
                       mode: str = "shm", directory: Optional[str] = None, api_key: Optional[str] = None,
                       wait_for_inflight: bool = True, keep_file: bool = False) -> dict:
    """Load new weights into one server (see ``push_weights_to_all``); returns write_s, load_s, total_s."""
    return await push_weights_to_all([base_url], named_weights, weight_version, mode=mode, directory=directory,
                                     api_key=api_key, wait_for_inflight=wait_for_inflight, keep_file=keep_file)
