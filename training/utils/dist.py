"""Process groups and the rank-0 command protocol: the ground floor of running under ``torchrun``.

    torchrun --nproc-per-node 2 train.py        # the same train.py as for one process

Single process (``WORLD_SIZE`` unset or 1): nothing here starts; ``is_distributed()`` is
False, ``is_main_rank()`` True, and every helper is the identity or a no-op.

Under ``torchrun`` (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` set):

- ``init_distributed`` starts the default process group: ``cpu:gloo,cuda:nccl`` when the
  trainer runs on CUDA (NCCL for the model, gloo for the small CPU messages), plain ``gloo``
  on CPU; with a timeout (``TRAINING_DIST_TIMEOUT_S``, default 1800 s) so that a dead rank 0
  does not hang the others forever. On the mixed group it also makes a gloo group of every rank for
  the exit barrier (``monitored_barrier`` is gloo only).
- Rank 0 runs the recipe (deployment, rollouts, gate, logging, metrics). The other ranks run
  ``follow``: a loop that waits for a ``Command`` and then takes part in that command's
  collectives in the same order as rank 0 (the handlers live with the recipe).
- The protocol: every exchange starts with rank 0 broadcasting one int64 ``[2]`` tensor
  ``(command, arg)`` (``lead``), followed by that command's collectives. Batches travel as
  plain tensors (lengths first, then the data, ``broadcast_tensor``); nothing received from
  another process is ever unpickled. Metric names travel as UTF-8 bytes (``reduce_metrics``).

FSDP2 sharding and the split of a batch over ranks live with the trainer
(``training/trainer/distributed.py``).
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
from enum import IntEnum
from typing import Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from training.utils.device import resolve_device

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 1800.0
"""Process-group timeout when ``TRAINING_DIST_TIMEOUT_S`` is not set."""
EXIT_BARRIER_TIMEOUT_S = 60.0
"""How long ``shutdown_distributed`` waits for the other ranks before leaving anyway."""


class Command(IntEnum):
    """What rank 0 asks the other ranks to take part in next."""

    STOP = 0
    """Leave the follower loop (rank 0 finished, or failed)."""
    TRAIN = 1
    """One PPO step: the step's batch follows (``StepBatch.broadcast``), then ``train_on_batch``."""
    WEIGHTS = 2
    """One pass of ``PolicyTrainer.named_weights`` (a full-tensor gather per parameter)."""
    CHECKPOINT = 3
    """``save_checkpoint`` of step ``arg`` (a sharded DCP write)."""
    EXPORT = 4
    """``PolicyTrainer.save_pretrained`` into ``<log_path>/final``."""


_started_here = False
_exit_group: Optional[dist.ProcessGroup] = None
"""The gloo group of the exit barrier on a mixed ``cpu:gloo,cuda:nccl`` default group (``exit_barrier_group``)."""
_broken = False
"""Set when an error escaped a command on rank 0: the followers may be inside its collectives."""
_lock = threading.RLock()
_leading = threading.local()


# ---- process group ---------------------------------------------------------------------------
def launched_by_torchrun() -> bool:
    """True when ``WORLD_SIZE`` says more than one process takes part."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init_distributed(device: str = "auto") -> bool:
    """Start the default process group from torchrun's env vars; True if this call started it.

    Does nothing (returns False) in a single process or when a group already exists.
    ``device`` (``TrainerConfig.device``: ``auto``, ``cpu``, ``cuda``...) picks the backend.
    """
    global _started_here
    if not launched_by_torchrun() or (dist.is_available() and dist.is_initialized()):
        return False
    for var in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        if var not in os.environ:
            raise RuntimeError(f"{var}: not set although WORLD_SIZE > 1; launch with torchrun")
    device_type = resolve_device(device).type
    backend = "cpu:gloo,cuda:nccl" if device_type == "cuda" else "gloo"
    if device_type == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    timeout = datetime.timedelta(seconds=float(os.environ.get("TRAINING_DIST_TIMEOUT_S", DEFAULT_TIMEOUT_S)))
    dist.init_process_group(backend=backend, timeout=timeout)
    _started_here = True
    global _exit_group
    _exit_group = exit_barrier_group(backend)
    logger.info("rank %d of %d started (%s)", rank(), world_size(), backend)
    return True


def exit_barrier_group(backend: str) -> Optional[dist.ProcessGroup]:
    """The group the exit barrier runs on: None (the default group) when ``backend`` is plain gloo, else a
    gloo group of every rank, created now (a collective: every rank calls it at start, while all are
    alive). ``monitored_barrier`` exists for gloo only: on the trainer's ``cpu:gloo,cuda:nccl`` group it raises."""
    if backend == "gloo":
        return None
    return dist.new_group(backend="gloo")


def shutdown_distributed() -> None:
    """Destroy the process group if ``init_distributed`` started it, after a barrier.

    The barrier makes the ranks leave together: a rank that exits while its peer is still using the
    group can abort in gloo's teardown at interpreter exit (``terminate called without an active
    exception``, seen 1 run in 5 under load without it). A peer that is gone or has not arrived within
    ``EXIT_BARRIER_TIMEOUT_S`` (a gloo ``monitored_barrier``, which names it) is logged, not raised.
    """
    global _started_here, _exit_group
    if _started_here and dist.is_initialized():
        try:
            dist.monitored_barrier(group=_exit_group, timeout=datetime.timedelta(seconds=EXIT_BARRIER_TIMEOUT_S))
        except Exception as e:  # noqa: BLE001 - a peer already gone or stuck; leave anyway
            logger.warning("rank %d: leaving without the exit barrier (%s)", rank(), e)
        dist.destroy_process_group()
    _started_here = False
    _exit_group = None


def is_distributed() -> bool:
    """True inside a process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def is_main_rank() -> bool:
    """True on rank 0, and in a single process. Only this rank talks to the deployment and writes logs."""
    return rank() == 0


def device_for_rank(device: torch.device) -> torch.device:
    """Under torchrun, ``cuda`` means this process's GPU (``cuda:LOCAL_RANK``); other devices as given."""
    if is_distributed() and device.type == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def barrier() -> None:
    if is_distributed():
        dist.barrier()


# ---- collectives on small CPU tensors -------------------------------------------------------------
def max_over_ranks(value: int) -> int:
    if not is_distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def all_reduce_sum_(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks in place (identity in a single process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def broadcast_tensor(tensor: Optional[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Rank 0's 1-D CPU ``tensor`` on every rank (others pass None): the length first, then the data."""
    if not is_distributed():
        if tensor is None:
            raise ValueError("tensor: required in a single process")
        return tensor.to(dtype)
    if is_main_rank():
        if tensor is None or tensor.ndim != 1:
            raise ValueError("tensor: rank 0 must pass a 1-D tensor")
        data = tensor.to(dtype=dtype, device="cpu").contiguous()
        size = torch.tensor([data.numel()], dtype=torch.int64)
    else:
        size = torch.zeros(1, dtype=torch.int64)
    dist.broadcast(size, src=0)
    if not is_main_rank():
        data = torch.empty(int(size.item()), dtype=dtype)
    dist.broadcast(data, src=0)
    return data


def _all_gather_strings(strings: list[str]) -> list[list[str]]:
    """Every rank's list of strings, exchanged as UTF-8 bytes (no pickling)."""
    blob = torch.tensor(list("\n".join(strings).encode("utf-8")), dtype=torch.uint8)
    size = max_over_ranks(blob.numel())
    padded = torch.zeros(size + 1, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    padded[-1] = blob.numel() > 0  # an empty list and [""] differ
    gathered = [torch.empty_like(padded) for _ in range(world_size())]
    dist.all_gather(gathered, padded)
    out = []
    for g in gathered:
        text = bytes(g[:-1].tolist()).rstrip(b"\0").decode("utf-8")
        out.append(text.split("\n") if int(g[-1]) else [])
    return out


def reduce_metrics(metrics: dict[str, float], weight: float, sum_keys: Sequence[str] = ()) -> dict[str, float]:
    """Combine each rank's metrics into the step's: ``*_max`` → max, ``*_min`` → min, ``sum_keys``
    → sum, others → mean weighted by each rank's ``weight`` (its token count). Keys missing on a
    rank count as absent there. Identity in a single process."""
    if not is_distributed():
        return dict(metrics)
    keys = sorted({k for ks in _all_gather_strings(sorted(metrics)) for k in ks})
    n = len(keys)
    sums = torch.zeros(2 * n, dtype=torch.float64)  # value * weight (or the value for sum_keys), weight
    maxima = torch.full((n,), -float("inf"), dtype=torch.float64)  # max, and -min
    for i, k in enumerate(keys):
        if k not in metrics:
            continue
        v = float(metrics[k])
        if k.endswith("_max"):
            maxima[i] = v
        elif k.endswith("_min"):
            maxima[i] = -v
        elif k in sum_keys:
            sums[i], sums[n + i] = v, 1.0
        else:
            sums[i], sums[n + i] = v * weight, weight
    dist.all_reduce(sums, op=dist.ReduceOp.SUM)
    dist.all_reduce(maxima, op=dist.ReduceOp.MAX)
    out = {}
    for i, k in enumerate(keys):
        if k.endswith("_max"):
            out[k] = float(maxima[i])
        elif k.endswith("_min"):
            out[k] = -float(maxima[i])
        elif k in sum_keys:
            out[k] = float(sums[i])
        else:
            out[k] = float(sums[i] / sums[n + i]) if sums[n + i] > 0 else 0.0
    return out


# ---- commands ---------------------------------------------------------------------------------
@contextlib.contextmanager
def lead(command: Command, arg: int = 0) -> Iterator[None]:
    """On rank 0 under torchrun: hold the command lock and announce ``(command, arg)`` to the
    other ranks, which then run the same collectives as the body. Nested ``lead`` calls in one
    thread announce nothing (the followers are already inside the outer command). Elsewhere a
    no-op. The lock keeps two threads of rank 0 (e.g. two replicas' weight pushes) from
    interleaving their collectives."""
    if not (is_distributed() and is_main_rank()):
        yield
        return
    with _lock:
        depth = getattr(_leading, "depth", 0)
        if depth == 0:
            dist.broadcast(torch.tensor([int(command), int(arg)], dtype=torch.int64), src=0)
        _leading.depth = depth + 1
        try:
            yield
        except GeneratorExit:  # a generator body (named_weights) closed early finishes its collectives itself
            raise
        except BaseException:
            global _broken
            _broken = True
            raise
        finally:
            _leading.depth = depth


def receive_command() -> tuple[Command, int]:
    """On a follower: wait for rank 0's next ``(command, arg)``."""
    message = torch.zeros(2, dtype=torch.int64)
    dist.broadcast(message, src=0)
    return Command(int(message[0])), int(message[1])


def stop_followers(arg: int = 0) -> None:
    """Rank 0: release the followers (call in a ``finally``). No-op elsewhere.

    After an error inside a command the followers may be waiting in one of its collectives, so
    no STOP is sent: rank 0 exits with the error and torchrun stops the other ranks (or the
    process-group timeout does).
    """
    if not (is_distributed() and is_main_rank()):
        return
    if _broken:
        logger.warning("rank 0 failed inside a collective command; not sending STOP (torchrun stops the others)")
        return
    with lead(Command.STOP, arg):
        pass


def follow(handlers: dict[Command, Callable[[int], None]]) -> int:
    """On a follower: run ``handlers[command](arg)`` for each command until ``STOP``; return STOP's arg."""
    while True:
        command, arg = receive_command()
        if command == Command.STOP:
            return arg
        handler = handlers.get(command)
        if handler is None:
            raise RuntimeError(f"rank {rank()}: no handler for command {command.name}")
        handler(arg)
