"""One OpenMP worker pool per process: threads that only help free theirs when done.

torch's CPU build on Linux runs its parallel ops on GNU OpenMP (libgomp). Every thread that runs
a parallel region gets its own pool of worker threads, kept until that thread exits, and libgomp
counts every pooled thread. Once the count exceeds the CPUs, a worker spins only a few hundred
cycles after each region before it sleeps, so every one of the hundreds of parallel regions of a
forward pass then pays a sleep and a futex wake.

That is what happens when one thread loads a model and another computes with it (the server's
engine thread, the recipe's trainer thread), or when a helper thread (``asyncio.to_thread``)
validates or writes weights. Measured on 2 cores (SmolLM2 decode-heavy run of the engine): 20.8 s
with one pool, 25–28 s once the loading thread kept its pool, 117k voluntary context switches
against 12.

:func:`release_openmp_threads` frees the calling thread's pool (libgomp's
``omp_pause_resource_all``, OpenMP 5.0); the next parallel region on that thread builds a new one.
Call it on a thread after its parallel work when another thread does the computing;
:func:`releasing_openmp_threads` wraps a function run in a helper thread.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable, Optional, TypeVar

T = TypeVar("T")

OMP_PAUSE_HARD = 2
"""``omp_pause_hard``: free the threads (``omp_pause_soft`` = 1 may keep them)."""

_LIBGOMP: Optional[list] = None


def _loaded_libgomp() -> list:
    """The libgomp copies loaded into this process (torch ships its own), found in ``/proc/self/maps``."""
    global _LIBGOMP
    if _LIBGOMP is None:
        _LIBGOMP = []
        if sys.platform.startswith("linux"):
            try:
                with open("/proc/self/maps") as f:
                    paths = {line.split()[-1] for line in f if "libgomp" in line and "/" in line}
            except OSError:
                paths = set()
            for path in sorted(paths):
                try:
                    lib = ctypes.CDLL(path)
                    fn = lib.omp_pause_resource_all
                except (OSError, AttributeError):  # an old libgomp without OpenMP 5.0
                    continue
                fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
                _LIBGOMP.append(fn)
    return _LIBGOMP


def release_openmp_threads() -> bool:
    """Free the calling thread's OpenMP worker threads; True if a libgomp was found and did it.

    Only the caller's own pool goes (threads computing elsewhere keep theirs); nothing to do, and
    False, off Linux or without libgomp. Must not be called from inside a parallel region (it is
    not, from Python).
    """
    if "torch" not in sys.modules:  # no torch, no pools of its making
        return False
    done = False
    for pause in _loaded_libgomp():
        done = pause(OMP_PAUSE_HARD) == 0 or done
    return done


def releasing_openmp_threads(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` then :func:`release_openmp_threads`, for work handed to a helper thread that outlives it."""

    @functools.wraps(fn)
    def run(*args, **kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        finally:
            release_openmp_threads()

    return run
