"""Weight sync across hosts: the trainer broadcasts tensors to the servers over torch.distributed.

Group: rank 0 is the trainer, ranks 1..k are the servers' members (one per embedded server, one per worker of
a vLLM server: ``server_ranks``). The trainer hosts a ``TCPStore`` at
``master_addr:master_port`` and every member builds a ProcessGroup directly on that store
(``ProcessGroupGloo`` / ``ProcessGroupNCCL``), so the default group (FSDP2 under torchrun) is
never touched. Nothing is pickled: metadata travels as JSON over HTTP, tensors as raw bytes.

One update (``DistributedWeightSender.push``):

1. ``POST /update_weights_from_distributed`` to every server with the metadata
   (``names``, ``dtypes``, ``shapes``, ``bucket_bytes``, ``weight_version``, ``wait_for_inflight``,
   ``update_id``). ``dtypes`` are the wire dtypes: with ``push(dtype=...)`` (the server's own dtype,
   which ``DeploymentGroup`` reads from ``GET /weight_version``) each tensor is cast just before it
   is staged, so a bf16 server receives bf16 bytes straight into its live weights.
   Each server checks it against its model (400 naming the field; old weights kept) and, if it
   accepts, writes ``accepted`` under the update id in the store.
2. Once every server accepted, the trainer writes ``go`` (or ``abort`` if one refused, so the
   others drop the update untouched) and broadcasts the tensors in metadata order, flattened into
   buckets of up to ``bucket_bytes`` (``weights/buckets.py``: one broadcast per bucket, one host
   sync per push; 0 = tensor by tensor).
3. Each server's engine thread receives them at the moment a disk/shm update would be swapped in
   (``wait_for_inflight``: running sequences finish on the old weights first) and copies each
   bucket's tensors into place before receiving the next. The HTTP answer carries the new version.

Memory: the trainer holds one bucket plus one tensor (gathered / cast / moved to the comm device,
freed once copied into the bucket); a server receives a lone tensor straight into the live tensor
when dtype, device and layout allow (no extra memory), otherwise into a scratch buffer the size of
one bucket. A failure half-way through the
stream leaves a server's weights a mix: it then reports ``weight_version = -1`` until the next
full update.

Under torchrun with FSDP2, rank 0 pushes and every other trainer rank iterates the same
``named_weights`` at the same time (gathering a DTensor is a collective): ``PolicyTrainer.named_weights``
announces the pass to the other ranks, which gather each tensor with rank 0 and drop it.
The server side is ``server/distributed_receiver.py``. The per-server requests (count the members, join,
update) are three methods a subclass replaces: ``backends/vllm_weights.py`` sends the same protocol through
vLLM's ``/collective_rpc`` and its worker extension.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import math
import os
import socket
import time
import uuid
from typing import Any, Iterable, Optional, Sequence

import aiohttp
import torch
import torch.distributed as dist

from training.deployment.weights.buckets import plan_buckets, tensor_bytes
from training.deployment.weights.files import WeightSyncError
from training.utils.http import auth_headers
from training.utils.openmp import releasing_openmp_threads

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
}
"""Wire dtype names (explicit map, never ``eval``); only floating-point weights move."""
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
BACKENDS = ("gloo", "nccl")
_PG_PREFIX = "weight_sync/pg"


def joined_key(rank: int) -> str:
    """Store key a server sets once it is connected to the store (before building the group)."""
    return f"weight_sync/joined/{rank}"


def accept_key(update_id: str, rank: int) -> str:
    """Store key a server sets when it accepted an update's metadata."""
    return f"weight_sync/update/{update_id}/accepted/{rank}"


def go_key(update_id: str) -> str:
    """Store key the trainer sets to ``go`` (broadcast follows) or ``abort`` (drop the update)."""
    return f"weight_sync/update/{update_id}/go"


def _local_addr_towards(host: str, port: int) -> Optional[str]:
    """The address of the local interface that routes to ``host`` (what gloo should bind); None if unknown."""
    try:
        family = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)[0][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port or 1))  # UDP connect sends nothing; it only picks the route
            return s.getsockname()[0]
    except OSError:
        return None


def make_process_group(
    store: dist.Store, rank: int, world_size: int, backend: str, timeout_s: float, bind_addr: Optional[str] = None
) -> Any:
    """A ProcessGroup on ``store`` outside the default group (blocks until every rank calls it).

    gloo binds ``bind_addr`` (None: the default device, which honours ``GLOO_SOCKET_IFNAME``);
    nccl is created lazily at the first collective (``NCCL_SOCKET_IFNAME`` applies).
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(_PG_PREFIX, store)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [
            dist.ProcessGroupGloo.create_device(hostname=bind_addr)
            if bind_addr
            else dist.ProcessGroupGloo.create_default_device()
        ]
        return dist.ProcessGroupGloo(prefixed, rank, world_size, opts)
    if backend == "nccl":
        if not hasattr(dist, "ProcessGroupNCCL"):
            raise ValueError("backend: 'nccl' needs a CUDA build of torch; use 'gloo'")
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
    raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")


def broadcast_from_trainer(pg: Any, tensor: torch.Tensor, sync: bool = True) -> None:
    """Broadcast ``tensor`` from rank 0 in place and wait for it; ``sync`` also waits on the host for
    CUDA (without it, later work on the current stream is ordered after the broadcast)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([tensor], opts).wait()
    if sync:
        sync_device(tensor.device)


def sync_device(device: torch.device) -> None:
    """Wait on the host for the work queued on ``device``'s current stream (nothing to do on CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def gloo_bind_addr(master_addr: str, master_port: int, backend: str) -> Optional[str]:
    """gloo's bind address: the interface towards the master, unless ``GLOO_SOCKET_IFNAME`` decides."""
    if backend != "gloo" or os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    return _local_addr_towards(master_addr, master_port)


# ============================================================================ trainer side


def unique_weights(named_weights: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs that travel, in order: a tensor seen before (tied) is skipped.

    Raises ValueError for a dtype outside ``DTYPES``, a duplicate name, or an empty set.
    """
    items, seen_tensors = [], set()
    for name, t in named_weights:
        key = id(t) if hasattr(t, "full_tensor") else (t.data_ptr(), t.storage_offset(), tuple(t.shape))
        if key in seen_tensors:  # tied tensors (lm_head = embedding) travel once
            continue
        seen_tensors.add(key)
        items.append((name, t))
    check_specs([(n, t.dtype, tuple(t.shape)) for n, t in items], what="named_weights")
    return items


def check_specs(
    specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]], what: str = "specs"
) -> list[tuple[str, torch.dtype, tuple]]:
    """``specs`` as a list, checked: at least one, names unique, dtypes in ``DTYPES`` (errors name ``what``)."""
    specs = [(n, d, tuple(shape)) for n, d, shape in specs]
    if not specs:
        raise ValueError(f"{what}: no tensors given")
    seen = set()
    for n, d, _ in specs:
        if n in seen:
            raise ValueError(f"{what}: duplicate tensor name {n!r}")
        if d not in DTYPE_NAMES:
            raise ValueError(f"{what}: {n}: dtype {d} is not one of {sorted(DTYPES)}")
        seen.add(n)
    return specs


def _materialize(t: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The full tensor on the comm device in the wire dtype (a DTensor is gathered: every trainer rank
    must call this)."""
    if hasattr(t, "full_tensor"):
        t = t.full_tensor()
    return t.detach().to(device=device, dtype=dtype).contiguous()


class DistributedWeightSender:
    """Trainer rank 0 of a weight-update group with the servers at ``base_urls`` (ranks 1..k).

    ``master_addr`` is the trainer's address as the servers can reach it; ``master_port`` 0
    picks a free port (read it back from ``master_port`` after ``connect()``). ``bucket_bytes``:
    the size of the flat buffers tensors are broadcast in (0: tensor by tensor; see
    ``weights/buckets.py``).
    """

    def __init__(
        self,
        base_urls: Sequence[str],
        master_addr: str,
        master_port: int = 0,
        backend: str = "gloo",
        *,
        api_key: Optional[str] = None,
        timeout_s: float = 600.0,
        device: Optional[torch.device | str] = None,
        bucket_bytes: int = 0,
    ):
        if not base_urls:
            raise ValueError("base_urls: at least one server is needed")
        if not isinstance(master_addr, str) or not master_addr:
            raise ValueError("master_addr: the trainer's address as the servers reach it is required")
        if backend not in BACKENDS:
            raise ValueError(f"backend: {backend!r} is not one of {BACKENDS}")
        if not isinstance(master_port, int) or not 0 <= master_port <= 65535:
            raise ValueError(f"master_port: must be an integer in [0, 65535], got {master_port!r}")
        if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
            raise ValueError(f"bucket_bytes: must be an integer >= 0, got {bucket_bytes!r}")
        self.bucket_bytes = bucket_bytes
        self.base_urls = [u.rstrip("/") for u in base_urls]
        self.master_addr, self.master_port, self.backend = master_addr, master_port, backend
        self.api_key, self.timeout_s = api_key, timeout_s
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else "cpu"
        self.device = torch.device(device)
        self.store: Optional[dist.TCPStore] = None
        self.pg: Any = None
        self.server_ranks: list[int] = [1] * len(self.base_urls)
        """Group members per server (a vLLM server with tensor parallel holds one per worker), set by ``connect``."""
        self._lock = asyncio.Lock()
        self.broadcast_started = False
        """Whether the last ``push`` got as far as the broadcast (False: it failed or was refused before any tensor
        was read or moved, so it may be sent again with the same ``named_weights``)."""

    @classmethod
    def from_replicas(cls, replicas: Sequence[Any], master_addr: str, **kwargs: Any) -> "DistributedWeightSender":
        """A sender to the servers of ``replicas`` (``ServerProcess`` objects; this class needs only their
        ``base_url``); how ``DeploymentGroup`` builds the sender its backend names (``Backend.weight_sender``)."""
        return cls([r.base_url for r in replicas], master_addr, **kwargs)

    @property
    def world_size(self) -> int:
        return sum(self.server_ranks) + 1

    def first_rank(self, index: int) -> int:
        """The group rank of server ``index``'s first member (its others follow it)."""
        return 1 + sum(self.server_ranks[:index])

    # ---------------------------------------------------------------- per-server requests (a subclass's protocol)
    async def _count_ranks(self, session: aiohttp.ClientSession) -> None:
        """Set ``server_ranks`` (group members per server) before the group forms: one each here."""
        self.server_ranks = [1] * len(self.base_urls)

    async def _join_server(self, session: aiohttp.ClientSession, index: int, body: dict) -> dict:
        """Ask server ``index`` to join (``body``: master_addr, master_port, rank (its first), world_size,
        backend, timeout_s); returns once it joined. Its members set ``joined_key(rank)`` before joining."""
        return await self._post(session, f"{self.base_urls[index]}/init_weight_update_group", body)

    async def _update_server(self, session: aiohttp.ClientSession, index: int, body: dict) -> dict:
        """Send server ``index`` one update's metadata (``body``); its members set ``accept_key`` for their ranks,
        wait for ``go_key``, receive, and the answer (once loaded) carries ``weight_version``."""
        return await self._post(session, f"{self.base_urls[index]}/update_weights_from_distributed", body)

    async def __aenter__(self) -> "DistributedWeightSender":
        await self.connect()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()

    def _session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(
            headers=auth_headers(self.api_key), timeout=aiohttp.ClientTimeout(total=self.timeout_s)
        )

    async def _post(self, session: aiohttp.ClientSession, url: str, body: dict) -> dict:
        try:
            async with session.post(url, json=body) as resp:
                text = await resp.text()
                if resp.status >= 400:
                    raise WeightSyncError(f"{url}: HTTP {resp.status}: {text[:2000]}")
                return json.loads(text)
        except aiohttp.ClientError as e:
            raise WeightSyncError(f"{url}: {type(e).__name__}: {e}") from e

    async def _wait_keys(self, keys: list[str], tasks: list[asyncio.Task]) -> None:
        """Return once every key is in the store; raise the first failed HTTP task's error first."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            for t in tasks:
                if t.done() and t.exception() is not None:
                    raise t.exception()
            if self.store.check(keys):
                return
            if time.monotonic() > deadline:
                raise WeightSyncError(f"servers did not answer within {self.timeout_s} s (waiting for {keys})")
            await asyncio.sleep(0.005)

    async def connect(self) -> None:
        """Count each server's members, host the store, ask every server to join (``POST
        /init_weight_update_group``), join as rank 0."""
        if self.pg is not None:
            return
        async with self._session() as session:
            await self._count_ranks(session)
            self.store = dist.TCPStore(
                self.master_addr,
                self.master_port,
                self.world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.timeout_s),
            )
            self.master_port = self.store.port
            tasks = [
                asyncio.ensure_future(
                    self._join_server(
                        session,
                        i,
                        {
                            "master_addr": self.master_addr,
                            "master_port": self.master_port,
                            "rank": self.first_rank(i),
                            "world_size": self.world_size,
                            "backend": self.backend,
                            "timeout_s": self.timeout_s,
                        },
                    )
                )
                for i in range(len(self.base_urls))
            ]
            try:
                await self._wait_keys([joined_key(r) for r in range(1, self.world_size)], tasks)
                bind = gloo_bind_addr(self.master_addr, self.master_port, self.backend)
                self.pg = await asyncio.to_thread(
                    make_process_group, self.store, 0, self.world_size, self.backend, self.timeout_s, bind
                )
                await asyncio.gather(*tasks)
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                self.close()
                raise

    def close(self) -> None:
        """Leave the group and stop the store (servers keep serving; a new sender may connect later)."""
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:
                pass
        self.store = None

    async def push(
        self,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        weight_version: int,
        *,
        wait_for_inflight: bool = True,
        specs: Optional[Sequence[tuple[str, torch.dtype, tuple[int, ...]]]] = None,
        dtype: Optional[torch.dtype] = None,
    ) -> dict:
        """Send metadata, then broadcast each tensor; return once every server reports ``weight_version``.

        Returns ``{"bytes", "num_tensors", "broadcast_s", "total_s", "peak_tensor_bytes", "servers"}``;
        ``peak_tensor_bytes`` is the largest tensor staged, an upper bound on the trainer's extra memory
        (nothing is staged for a contiguous tensor already on the comm device).
        Raises ``WeightSyncError`` naming the server that refused or failed; when a server refuses the
        metadata no tensor moves and every server keeps its old weights.

        ``specs``: ``(name, dtype, shape)`` of what ``named_weights`` will yield, in order (tied
        tensors already left out), e.g. ``PolicyTrainer.weight_specs()``. Given, the metadata is
        sent from it and ``named_weights`` is consumed lazily during the broadcast, one tensor at
        a time: a generator that gathers each tensor (FSDP2's ``PolicyTrainer.named_weights()``)
        then never holds more than one. A yielded tensor that does not match its spec stops the
        broadcast with ``WeightSyncError`` (the servers then report version -1 until a full update).
        """
        async with self._lock:
            self.broadcast_started = False
            await self.connect()
            t0 = time.perf_counter()
            if specs is None:
                stream = unique_weights(named_weights)
                specs = [(n, t.dtype, tuple(t.shape)) for n, t in stream]
            else:
                stream, specs = named_weights, check_specs(specs)
            if dtype is not None and dtype not in DTYPE_NAMES:
                raise ValueError(f"dtype: {dtype} is not one of {sorted(DTYPES)}")
            wire = [dtype or d for _, d, _ in specs]
            uid = f"v{weight_version}-{uuid.uuid4().hex[:12]}"
            body = {
                "names": [n for n, _, _ in specs],
                "dtypes": [DTYPE_NAMES[d] for d in wire],
                "shapes": [list(shape) for _, _, shape in specs],
                "bucket_bytes": self.bucket_bytes,
                "weight_version": weight_version,
                "wait_for_inflight": wait_for_inflight,
                "update_id": uid,
            }
            async with self._session() as session:
                tasks = [
                    asyncio.ensure_future(self._update_server(session, i, body)) for i in range(len(self.base_urls))
                ]
                try:
                    await self._wait_keys([accept_key(uid, r) for r in range(1, self.world_size)], tasks)
                except BaseException as first:  # no tensor moved: tell the servers that accepted to drop it
                    self.store.set(go_key(uid), b"abort")
                    results = await asyncio.gather(*tasks, return_exceptions=True)
                    if not isinstance(first, WeightSyncError):
                        raise
                    errors = [str(r) for r in results if isinstance(r, BaseException)]
                    raise WeightSyncError(
                        f"weight update v{weight_version} refused, every server keeps its old "
                        f"weights: " + "; ".join(errors or [str(first)])
                    ) from first
                self.store.set(go_key(uid), b"go")
                self.broadcast_started = True
                t1 = time.perf_counter()
                try:
                    sent, peak = await asyncio.to_thread(
                        releasing_openmp_threads(self._broadcast_all), stream, specs, wire
                    )
                except Exception as e:
                    local = isinstance(e, WeightSyncError)  # named_weights broke its specs: no server is at fault
                    failed = "" if local else await _failed_servers(tasks, grace_s=5.0)
                    self.close()  # a broken collective cannot be reused (the next push reconnects)
                    await _failed_servers(tasks, grace_s=5.0)  # servers mid-broadcast fail now: let them settle at -1
                    for t in tasks:
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    if local:
                        raise WeightSyncError(f"broadcast stopped: {e}") from e
                    raise WeightSyncError(f"broadcast failed ({failed or 'no server answered yet'}): {e}") from e
                t2 = time.perf_counter()
                answers = await asyncio.gather(*tasks)
                for u, a in zip(self.base_urls, answers):
                    if a.get("weight_version") != weight_version:
                        raise WeightSyncError(
                            f"{u}: reports weight_version {a.get('weight_version')} after loading {weight_version}"
                        )
            return {
                "bytes": sent,
                "num_tensors": len(specs),
                "num_buckets": len(plan_buckets(wire, [s for _, _, s in specs], self.bucket_bytes)),
                "broadcast_s": t2 - t1,
                "total_s": time.perf_counter() - t0,
                "peak_tensor_bytes": peak,
                "servers": dict(zip(self.base_urls, answers)),
            }

    def _broadcast_all(
        self,
        stream: Iterable[tuple[str, torch.Tensor]],
        specs: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        wire: Sequence[torch.dtype],
    ) -> tuple[int, int]:
        """Broadcast the tensors of ``stream`` in order, bucket by bucket, each checked against its spec
        first and cast to its ``wire`` dtype; returns (bytes sent, largest staging buffer in bytes)."""
        sent = peak = 0
        it = iter(stream)

        def take(i: int) -> torch.Tensor:
            name, dtype, shape = specs[i]
            got = next(it, None)
            if got is None or got[0] != name or got[1].dtype != dtype or tuple(got[1].shape) != tuple(shape):
                found = "nothing" if got is None else f"{got[0]!r} {got[1].dtype} {tuple(got[1].shape)}"
                raise WeightSyncError(f"named_weights: expected {name!r} {dtype} {tuple(shape)} (specs), got {found}")
            return _materialize(got[1], self.device, wire[i])

        for bucket in plan_buckets(wire, [s for _, _, s in specs], self.bucket_bytes):
            if len(bucket) == 1:
                buf = take(bucket[0])
            else:
                numels = [math.prod(specs[i][2]) for i in bucket]
                buf = torch.empty(sum(numels), dtype=wire[bucket[0]], device=self.device)
                offset = 0
                for i, n in zip(bucket, numels):
                    staged = take(i)
                    buf[offset : offset + n].copy_(staged.reshape(-1))
                    offset += n
                    del staged  # one staging tensor at a time
            broadcast_from_trainer(self.pg, buf, sync=False)
            nbytes = sum(tensor_bytes(wire[i], specs[i][2]) for i in bucket)
            sent, peak = sent + nbytes, max(peak, nbytes)
            del buf
        sync_device(self.device)  # one host sync per push
        if next(it, None) is not None:
            raise WeightSyncError("named_weights: yielded more tensors than its specs list")
        return sent, peak


async def _failed_servers(tasks: list[asyncio.Task], grace_s: float) -> str:
    """The errors of the update requests that failed within ``grace_s`` (to name the culprit)."""
    done, _ = await asyncio.wait(tasks, timeout=grace_s)
    return "; ".join(str(t.exception()) for t in done if t.exception() is not None)
