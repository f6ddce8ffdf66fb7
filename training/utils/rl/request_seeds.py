"""Sampling seeds that survive a restart: derived from what a request is, not from a stream.

A server's own seed stream (``EngineConfig.seed``) starts over when the server restarts, so a
run resumed after a kill would draw other samples than the run that was never stopped. The
recipe therefore gives every training completion a ``seed_scope`` keyed by (run seed, submit
weight version, data position, completion index); inside it the deployment sampler
(``training.deployment.client``) stamps each request that has no ``seed`` of its own with
``next_request_seed()``: the scope's key hashed with a count of the requests made so far in that
completion (0, 1, 2 ... for a multi-turn rollout's calls, in the order they are made). A proxy episode
(``training/proxy/rollout.py``) takes one such seed as its session's ``seed_base``, and the proxy stamps each call
of the episode that names no ``seed`` with ``derive_seed(seed_base, k)`` (``training/proxy/forwarding.py``).

Evals run each row's completions in ``seed_scope(seed, row, k)`` too (``eval_rollouts.score_rows``), so a run's eval
and ``python -m training.eval --seed`` draw alike. Requests outside a scope (user code) and requests with an
explicit ``seed`` are unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
from dataclasses import dataclass
from typing import Iterator, Optional

SEED_BITS = 63
"""Derived seeds lie in [0, 2**63): valid for the server's ``seed`` field (a 64-bit generator seed)."""


def derive_seed(*key: int) -> int:
    """A seed in [0, 2**63) from integer ``key`` parts: the same parts give the same seed in any process."""
    if not key:
        raise ValueError("derive_seed: give at least one key part")
    for part in key:
        if not isinstance(part, int) or isinstance(part, bool):
            raise TypeError(f"derive_seed: key parts must be integers, got {part!r}")
    digest = hashlib.blake2b(",".join(str(p) for p in key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> (64 - SEED_BITS)


@dataclass
class _Scope:
    key: tuple[int, ...]
    requests: int = 0


_current: contextvars.ContextVar[Optional[_Scope]] = contextvars.ContextVar("request_seed_scope", default=None)


@contextlib.contextmanager
def seed_scope(*key: int) -> Iterator[None]:
    """Requests made inside (in this task and the tasks it starts) get seeds derived from ``key``."""
    derive_seed(*key)  # checks the key now, not at the first request
    token = _current.set(_Scope(tuple(key)))
    try:
        yield
    finally:
        _current.reset(token)


def next_request_seed() -> Optional[int]:
    """The seed for the next request of the current scope (counting it), or None outside any scope."""
    scope = _current.get()
    if scope is None:
        return None
    seed = derive_seed(*scope.key, scope.requests)
    scope.requests += 1
    return seed


def completion_seed_key(run_seed: int, submit_version: int, position: int, completion: int) -> tuple[int, ...]:
    """The scope key of one training completion: the same in a resumed run as in an uninterrupted one."""
    return (run_seed, submit_version, position, completion)
