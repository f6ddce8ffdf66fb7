"""What one node knows about itself, in modules light enough for a Ray task to import in a fresh worker (no torch):
its address, a free port, and whether it can write the run's shared path."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path


def node_address() -> str:
    """This node's address as Ray knows it (what other nodes reach it by)."""
    from training.launch.ray_import import import_ray

    return import_ray().util.get_node_ip_address()


def node_label() -> str:
    """``ADDRESS (node ID8)``: a node's name in the logs (raylets of one host share the address)."""
    from training.launch.ray_import import import_ray

    return f"{node_address()} ({import_ray().get_runtime_context().get_node_id()[:8]})"


def free_port() -> int:
    """A free TCP port on this node."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def check_writable(path: str) -> str:
    """Create ``path`` (a folder every node must reach) and write then remove a probe file in it; return this node's
    label. Raises ``OSError`` naming the path and the node."""
    where = node_label()
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
        probe = Path(path) / f".probe-{uuid.uuid4().hex[:8]}"
        probe.write_text(where)
        probe.unlink()
    except OSError as e:
        raise OSError(f"shared path {path}: not writable from node {where}: {e}") from None
    return where
