"""A thread that ran torch's parallel ops frees its OpenMP worker threads (training/utils/openmp.py)."""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from training.utils.openmp import release_openmp_threads, releasing_openmp_threads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="libgomp pools: Linux only")


def thread_ids() -> set[int]:
    """The process's OS thread ids (sets, not counts: a thread an earlier test left may exit meanwhile)."""
    return set(map(int, os.listdir("/proc/self/task")))


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


def measure_release() -> list[list[int]]:
    """Thread ids before a parallel region, with its pool, after a release, and after the next region;
    with whether the release found libgomp (as 1 / 0)."""

    def work():
        torch.set_num_threads(2)
        before = thread_ids()
        assert parallel_sum() == 4_000_000
        with_pool = thread_ids()
        released = release_openmp_threads()
        after = thread_ids()
        assert parallel_sum() == 4_000_000  # a new pool, same answer
        again = thread_ids()
        release_openmp_threads()
        return [sorted(before), sorted(with_pool), [int(released)], sorted(after), sorted(again)]

    return in_fresh_thread(work)


def test_release_frees_the_calling_threads_pool_and_the_next_region_builds_one():
    # in a fresh process: a thread another test left running could start or end mid-measurement here
    code = "import json; from tests.utils.test_openmp import measure_release; print(json.dumps(measure_release()))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, with_pool, (released,), after, again = map(set, json.loads(out.stdout.strip().splitlines()[-1]))
    assert released, "libgomp with omp_pause_resource_all not found in this process"
    workers = with_pool - before
    assert workers, "the parallel sum started no worker thread: nothing to measure"
    assert not workers & after  # the pool's workers are gone
    assert again - after  # the next parallel region built a pool again


def measure_wrapper() -> list[list[int]]:
    """Thread ids before, after a wrapped parallel region, and after a wrapped one that raised."""

    def failing():
        parallel_sum()
        raise ValueError("bad weights")

    def work():
        torch.set_num_threads(2)
        before = thread_ids()
        assert releasing_openmp_threads(parallel_sum)() == 4_000_000
        after_ok = thread_ids()
        try:
            releasing_openmp_threads(failing)()
        except ValueError as exc:
            assert "bad weights" in str(exc)
        else:
            raise AssertionError("the wrapped work's error was swallowed")
        return [sorted(before), sorted(after_ok), sorted(thread_ids())]

    return in_fresh_thread(work)


def test_releasing_wrapper_frees_the_pool_even_when_the_work_raises():
    # in a fresh process, as above: a thread another test left running could start mid-measurement here
    code = "import json; from tests.utils.test_openmp import measure_wrapper; print(json.dumps(measure_wrapper()))"
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    before, after_ok, after_error = map(set, json.loads(out.stdout.strip().splitlines()[-1]))
    assert not after_ok - before  # no worker left behind
    assert not after_error - before


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

    before = thread_ids()
    t = threading.Thread(target=computing)
    t.start()
    assert ready.wait(30)
    its_pool = thread_ids() - before - {t.native_id}
    assert its_pool, "the computing thread started no worker thread: nothing to measure"
    in_fresh_thread(lambda: (torch.set_num_threads(2), parallel_sum(), release_openmp_threads()))
    assert its_pool <= thread_ids()  # every worker of the other thread's pool is still there
    go.set()
    assert done.wait(30)
    t.join()
    assert results == [4_000_000, 4_000_000]
