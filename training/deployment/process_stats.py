"""The server process's own resources for ``GET /stats``: resident memory, open descriptors, sockets.

Read from ``/proc/self`` (Linux); elsewhere each value is None. ``bound`` of ``open_fds`` is the
process's soft ``RLIMIT_NOFILE``; resident memory has no configured bound (the soak benchmark,
``benchmarks/soak.py``, shows that it levels off).
"""

from __future__ import annotations

import os
import resource
from typing import Optional

PROC_SELF = "/proc/self"


def rss_bytes() -> Optional[int]:
    """Resident set size of this process in bytes (None without ``/proc``)."""
    try:
        with open(f"{PROC_SELF}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _fd_targets() -> Optional[list[str]]:
    try:
        names = os.listdir(f"{PROC_SELF}/fd")
    except OSError:
        return None
    targets = []
    for name in names:
        try:
            targets.append(os.readlink(f"{PROC_SELF}/fd/{name}"))
        except OSError:  # closed between the listing and the read
            continue
    return targets


def process_pools() -> dict[str, dict]:
    """``rss_bytes``, ``open_fds`` and ``open_sockets`` (listening and client sockets included), each as
    ``{"size": n, "bound": m}`` (``bound`` None where the process has none)."""
    targets = _fd_targets()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_bound = None if soft == resource.RLIM_INFINITY else soft
    return {
        "rss_bytes": {"size": rss_bytes(), "bound": None},
        "open_fds": {"size": None if targets is None else len(targets), "bound": fd_bound},
        "open_sockets": {
            "size": None if targets is None else sum(t.startswith("socket:") for t in targets),
            "bound": fd_bound,
        },
    }
