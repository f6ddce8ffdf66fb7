"""A thread that ran torch's parallel ops frees its OpenMP worker threads (training/utils/openmp.py)."""

import os
import sys
import threading

import pytest
import torch

from training.utils.openmp import release_openmp_threads, releasing_openmp_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp pools: Linux only")


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def parallel_sum() -> float:
    """A reduction large enough for torch to run it as an OpenMP parallel region."""
    return float(torch.ones(4_000_000).sum())


def in_fresh_thread(fn):
    """Run ``fn`` on a new thread (its own OpenMP state) and return what it returned."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # re-raised on the caller's thread
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_release_frees_the_calling_threads_pool_and_the_next_region_builds_one():
    def work():
        torch.set_num_threads(2)
        before = os_threads()
        assert parallel_sum() == 4_000_000
        with_pool = os_threads()
        released = release_openmp_threads()
        after = os_threads()
        assert parallel_sum() == 4_000_000  # a new pool, same answer
        again = os_threads()
        release_openmp_threads()
        return before, with_pool, released, after, again

    before, with_pool, released, after, again = in_fresh_thread(work)
    assert released, "libgomp with omp_pause_resource_all not found in this process"
    assert with_pool > before, "the parallel sum started no worker thread: nothing to measure"
    assert after == before
    assert again == with_pool


def test_releasing_wrapper_frees_the_pool_even_when_the_work_raises():
    def failing():
        parallel_sum()
        raise ValueError("bad weights")

    def work():
        torch.set_num_threads(2)
        before = os_threads()
        assert releasing_openmp_threads(parallel_sum)() == 4_000_000
        after_ok = os_threads()
        with pytest.raises(ValueError, match="bad weights"):
            releasing_openmp_threads(failing)()
        return before, after_ok, os_threads()

    before, after_ok, after_error = in_fresh_thread(work)
    assert after_ok == before
    assert after_error == before


def test_release_leaves_other_threads_pools_alone():
    """Only the caller's pool goes: a thread computing meanwhile keeps its workers and its results."""
    ready, go, done = threading.Event(), threading.Event(), threading.Event()
    results = []

    def computing():
        torch.set_num_threads(2)
        results.append(parallel_sum())
        ready.set()
        go.wait(30)
        results.append(parallel_sum())
        done.set()
        release_openmp_threads()

    t = threading.Thread(target=computing)
    t.start()
    assert ready.wait(30)
    with_its_pool = os_threads()
    in_fresh_thread(lambda: (torch.set_num_threads(2), parallel_sum(), release_openmp_threads()))
    assert os_threads() == with_its_pool
    go.set()
    assert done.wait(30)
    t.join()
    assert results == [4_000_000, 4_000_000]
