"""The server's end of the torch.distributed weight sync (ranks 1..k; the trainer is rank 0).

``app.py`` routes ``POST /init_weight_update_group`` to :func:`parse_group_body` +
:meth:`WeightUpdateGroup.join` (run in a thread, so the event loop keeps serving), and
``POST /update_weights_from_distributed`` to :func:`parse_update_body` (metadata checked before
any tensor moves: 400 naming the field, old weights kept), :meth:`WeightUpdateGroup.accept_and_wait_go`
and :meth:`WeightUpdateGroup.make_loader`, whose loader the engine thread runs at the moment a
disk/shm update would be swapped in. The protocol is described in ``weights/distributed.py``.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

import torch
import torch.distributed as dist

from training.deployment.weights.distributed import (
    BACKENDS,
    DTYPES,
    accept_key,
    gloo_bind_addr,
    broadcast_from_trainer,
    go_key,
    joined_key,
    make_process_group,
    sync_device,
)
from training.deployment.engine.requests import PartialWeightUpdateError, WeightUpdateError
from training.deployment.server.request_error import RequestError
from training.deployment.server.limits import DEFAULT_LIMITS, RequestLimits, check_join_timeout
from training.deployment.weights.buckets import plan_buckets


def in_daemon_thread(fn: Callable[..., Any], *args: Any, pending: Optional[set] = None) -> "asyncio.Future[Any]":
    """Run a blocking call (a join, a store wait) in a daemon thread; await its result.

    Unlike ``asyncio.to_thread`` the thread is never joined at exit: a peer that never comes
    cannot hold up SIGTERM. Cancelling the future leaves the thread to end at its own timeout.
    ``pending``: a set that holds the future until it is done (the server cancels them at shutdown).
    """
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[Any] = loop.create_future()
    if pending is not None:
        pending.add(fut)
        fut.add_done_callback(pending.discard)

    def settle(result: Any, error: Optional[BaseException]) -> None:
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)

    def run() -> None:
        try:
            result, error = fn(*args), None
        except BaseException as e:  # handed to the awaiting coroutine
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=run, name=f"weight-group-{getattr(fn, '__name__', 'call')}", daemon=True).start()
    return fut


@dataclass
class GroupSpec:
    """A validated ``POST /init_weight_update_group`` body."""

    master_addr: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    timeout_s: float = 600.0


def _int_field(body: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = body.get(name)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise RequestError(f"'{name}' must be an integer in [{lo}, {hi}], got {v!r}", name)
    return v


def parse_group_body(body: Any, limits: RequestLimits = DEFAULT_LIMITS) -> GroupSpec:
    """Validate an init body before any connection is tried; ``RequestError`` names the field
    (``timeout_s`` in [1, ``limits.max_join_timeout_s``], ports 1..65535, rank in [1, world_size))."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    addr = body.get("master_addr")
    if not isinstance(addr, str) or not addr or len(addr) > 253 or "\x00" in addr or not addr.isprintable():
        raise RequestError("'master_addr' must be a non-empty host name or address", "master_addr")
    port = _int_field(body, "master_port", 1, 65535)
    world = _int_field(body, "world_size", 2, 1 << 16)
    rank = _int_field(body, "rank", 1, world - 1)  # rank 0 is the trainer
    backend = body.get("backend", "gloo")
    if backend not in BACKENDS:
        raise RequestError(f"'backend' must be one of {BACKENDS}, got {backend!r}", "backend")
    timeout = check_join_timeout(body.get("timeout_s", min(600.0, limits.max_join_timeout_s)), limits)
    return GroupSpec(addr, port, rank, world, backend, timeout)


@dataclass
class UpdatePlan:
    """A validated ``POST /update_weights_from_distributed`` body: tensors in broadcast order."""

    names: list[str]
    dtypes: list[torch.dtype]
    shapes: list[tuple[int, ...]]
    weight_version: int
    wait_for_inflight: bool
    update_id: str
    bucket_bytes: int = 0
    """How the trainer flattened the tensors (``weight_buckets.plan_buckets``); 0: one at a time."""


def parse_update_body(body: Any, expected: Mapping[str, tuple[int, ...]], tied: bool) -> UpdatePlan:
    """Check the metadata against the model's weights (a full set, names exact); RequestError names the field."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    version = body.get("weight_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise RequestError(f"'weight_version' must be an integer, got {version!r}", "weight_version")
    wait = body.get("wait_for_inflight", True)
    if not isinstance(wait, bool):
        raise RequestError("'wait_for_inflight' must be a boolean", "wait_for_inflight")
    uid = body.get("update_id")
    if not isinstance(uid, str) or not uid or len(uid) > 128 or not all(c.isalnum() or c in "-_" for c in uid):
        raise RequestError("'update_id' must be 1-128 characters of [A-Za-z0-9_-]", "update_id")
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    for field, v in (("names", names), ("dtypes", dtypes), ("shapes", shapes)):
        if not isinstance(v, list):
            raise RequestError(f"'{field}' must be a list", field)
    if not (len(names) == len(dtypes) == len(shapes)):
        raise RequestError(
            f"'names', 'dtypes' and 'shapes' must have equal lengths, got {len(names)}, {len(dtypes)}, {len(shapes)}",
            "shapes",
        )
    bucket_bytes = body.get("bucket_bytes", 0)
    if not isinstance(bucket_bytes, int) or isinstance(bucket_bytes, bool) or bucket_bytes < 0:
        raise RequestError(f"'bucket_bytes' must be an integer >= 0, got {bucket_bytes!r}", "bucket_bytes")
    seen: set[str] = set()
    plan = UpdatePlan([], [], [], version, wait, uid, bucket_bytes)
    for i, (name, dt, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or name not in expected:
            hint = " (the model ties it to the embedding: leave it out)" if tied and name == "lm_head.weight" else ""
            raise RequestError(f"names[{i}]: {name!r} is not a weight of this model{hint}", "names")
        if name in seen:
            raise RequestError(f"names[{i}]: {name!r} appears twice", "names")
        seen.add(name)
        if not isinstance(dt, str) or dt not in DTYPES:  # a list is unhashable: never a lookup
            raise RequestError(f"dtypes[{i}]: {dt!r} is not one of {sorted(DTYPES)}", "dtypes")
        if not isinstance(shape, list) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        ):
            raise RequestError(f"shapes[{i}]: must be a list of non-negative integers, got {shape!r}", "shapes")
        if tuple(shape) != tuple(expected[name]):
            raise RequestError(
                f"shapes[{i}]: {shape} for {name!r} does not match the model's {list(expected[name])}", "shapes"
            )
        plan.names.append(name)
        plan.dtypes.append(DTYPES[dt])
        plan.shapes.append(tuple(shape))
    missing = sorted(set(expected) - seen)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise RequestError(f"names: {missing[0]!r} is missing{more}; a full set is required", "names")
    return plan


class WeightUpdateGroup:
    """The server's end of the group (rank >= 1). ``join()`` blocks until every rank joined."""

    def __init__(self, spec: GroupSpec):
        self.spec = spec
        self.store: Optional[dist.TCPStore] = None
        self.pg: Any = None

    def join(self) -> None:
        s = self.spec
        self.store = dist.TCPStore(
            s.master_addr, s.master_port, s.world_size, is_master=False, timeout=datetime.timedelta(seconds=s.timeout_s)
        )
        self.store.set(joined_key(s.rank), b"1")
        self.pg = make_process_group(
            self.store,
            s.rank,
            s.world_size,
            s.backend,
            s.timeout_s,
            gloo_bind_addr(s.master_addr, s.master_port, s.backend),
        )

    def close(self) -> None:
        pg, self.pg, self.store = self.pg, None, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # a group whose peers are gone may refuse a clean shutdown
                pass

    def accept_and_wait_go(self, update_id: str) -> bool:
        """Tell the trainer this server accepts the update; block for its go (True) or abort (False)."""
        self.store.set(accept_key(update_id, self.spec.rank), b"ok")
        return self.store.get(go_key(update_id)) == b"go"

    def make_loader(self, plan: UpdatePlan, targets: Mapping[str, torch.Tensor], stats: dict):
        """A callable for the engine thread: receive each bucket, copy its tensors into ``targets``.

        Fills ``stats`` with ``received_bytes`` and ``peak_buffer_bytes`` (0 when every tensor was
        received in place: a bucket of one tensor whose dtype, device and layout match its target).
        A local copy failure keeps draining the stream (so the other ranks are not left hanging),
        then raises; any failure after the first tensor is a ``PartialWeightUpdateError``.
        """
        pg, nccl = self.pg, self.spec.backend == "nccl"
        buckets = plan_buckets(plan.dtypes, plan.shapes, plan.bucket_bytes)

        @torch.no_grad()
        def load() -> None:
            copied, error = 0, None
            stats.update(received_bytes=0, peak_buffer_bytes=0)
            comm_device = torch.device("cpu")
            for bucket in buckets:
                first = targets[plan.names[bucket[0]]]
                dtype = plan.dtypes[bucket[0]]
                comm_device = first.device if nccl else torch.device("cpu")
                numels = [torch.Size(plan.shapes[i]).numel() for i in bucket]
                direct = (
                    len(bucket) == 1
                    and error is None
                    and first.dtype == dtype
                    and first.device == comm_device
                    and first.is_contiguous()
                )
                buf = first if direct else torch.empty(sum(numels), dtype=dtype, device=comm_device)
                nbytes = buf.numel() * buf.element_size()
                try:
                    broadcast_from_trainer(pg, buf, sync=False)
                except Exception as e:
                    name = plan.names[bucket[0]]
                    if copied or direct:
                        raise PartialWeightUpdateError(
                            f"receiving {name} failed after {copied} tensors were replaced: {e}"
                        ) from e
                    raise WeightUpdateError(f"receiving {name} failed (old weights kept): {e}") from e
                stats["received_bytes"] += nbytes
                if direct:
                    copied += 1
                    continue
                stats["peak_buffer_bytes"] = max(stats["peak_buffer_bytes"], nbytes)
                offset = 0
                for i, n in zip(bucket, numels):
                    if error is None:
                        try:
                            targets[plan.names[i]].copy_(buf[offset : offset + n].view(plan.shapes[i]))
                            copied += 1
                        except Exception as e:  # keep receiving: the collective must stay in step
                            error = (plan.names[i], e)
                    offset += n
                del buf
            sync_device(comm_device)  # one host sync per update
            if error is not None:
                cls = PartialWeightUpdateError if copied else WeightUpdateError
                raise cls(f"{error[0]}: copy failed: {error[1]}")

        return load
