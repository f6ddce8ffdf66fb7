"""The server process's own resources for ``GET /stats``: resident memory, the C heap, open descriptors, sockets.

Read from ``/proc/self`` and glibc's ``mallinfo2`` (Linux, glibc 2.33+); elsewhere each value is None.
``bound`` of ``open_fds`` is the process's soft ``RLIMIT_NOFILE``; memory has no configured bound (the
soak benchmark, ``benchmarks/soak.py``, shows that it levels off). The heap tells a leak from
fragmentation: ``heap_in_use_bytes`` (what the process's C, C++ and Python code holds from malloc,
its mmapped blocks included) grows with a leak or a cache filling (``kernel_caches.py``);
``heap_free_bytes`` (freed, but kept by the allocator in its arenas) grows with fragmentation.
"""

from __future__ import annotations

import ctypes
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


_MALLINFO2_FIELDS = (
    "arena",
    "ordblks",
    "smblks",
    "hblks",
    "hblkhd",
    "usmblks",
    "fsmblks",
    "uordblks",
    "fordblks",
    "keepcost",
)


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``: ``uordblks`` bytes in use in the arenas, ``hblkhd`` in mmapped blocks,
    ``fordblks`` free in the arenas."""

    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS]


_MALLINFO2 = None


def _mallinfo2():
    """glibc's ``mallinfo2`` (None where there is none: another libc, or glibc before 2.33)."""
    global _MALLINFO2
    if _MALLINFO2 is None:
        try:
            fn = ctypes.CDLL(None).mallinfo2
            fn.restype, fn.argtypes = _MallInfo2, []
            _MALLINFO2 = fn
        except (OSError, AttributeError):
            _MALLINFO2 = False
    return _MALLINFO2 or None


def heap_bytes() -> tuple[Optional[int], Optional[int]]:
    """(bytes in use, bytes free in the arenas) of the C heap, over every arena; (None, None) without glibc."""
    fn = _mallinfo2()
    if fn is None:
        return None, None
    info = fn()
    return int(info.uordblks + info.hblkhd), int(info.fordblks)


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
    """``rss_bytes``, ``heap_in_use_bytes``, ``heap_free_bytes``, ``open_fds`` and ``open_sockets`` (listening
    and client sockets included), each as ``{"size": n, "bound": m}`` (``bound`` None where the process has none)."""
    targets = _fd_targets()
    in_use, free = heap_bytes()
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    fd_bound = None if soft == resource.RLIM_INFINITY else soft
    return {
        "rss_bytes": {"size": rss_bytes(), "bound": None},
        "heap_in_use_bytes": {"size": in_use, "bound": None},
        "heap_free_bytes": {"size": free, "bound": None},
        "open_fds": {"size": None if targets is None else len(targets), "bound": fd_bound},
        "open_sockets": {
            "size": None if targets is None else sum(t.startswith("socket:") for t in targets),
            "bound": fd_bound,
        },
    }
