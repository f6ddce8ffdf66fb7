"""The proxy's session table: bounded, idle sessions expire (the keys are in ``access.py``).

``SessionTable`` keeps the open sessions in order of last activity (a call starting or
ending, a reward, opening). ``admit`` (a new session) first drops sessions idle for longer than
``idle_s``, then, at ``max_sessions``, the least recently active one; a session with a call in
flight is never dropped (when every one has a call in flight, ``admit`` raises ``SessionTableFull``).
A dropped session is remembered as closed with the reason (its later calls get 410, and the
recipe's ``close`` returns a record whose ``evicted`` says why); the closed ids remembered are
bounded too (``CLOSED_IDS_PER_SESSION × max_sessions``, oldest forgotten first).
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator, Optional

from training.proxy.records import SessionRecord

DEFAULT_MAX_SESSIONS = 4096
"""``ProxyServer(max_sessions=...)`` default: open sessions kept at most."""
DEFAULT_SESSION_IDLE_S = 3600.0
"""``ProxyServer(session_idle_s=...)`` default: a session without activity for this long is dropped."""
CLOSED_IDS_PER_SESSION = 4
"""Closed ids remembered (so a straggler gets 410) = this × ``max_sessions``."""


class SessionTableFull(RuntimeError):
    """Every open session has a call in flight and the table is at ``max_sessions``."""


class SessionTable:
    """Open sessions by id, least recently active first; closed ids with the reason (module docstring)."""

    def __init__(self, max_sessions: int = DEFAULT_MAX_SESSIONS, idle_s: float = DEFAULT_SESSION_IDLE_S):
        if max_sessions < 1:
            raise ValueError(f"max_sessions: must be >= 1, got {max_sessions}")
        if not idle_s > 0:
            raise ValueError(f"session_idle_s: must be > 0, got {idle_s}")
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self.open: dict[str, SessionRecord] = {}
        self.closed: dict[str, str] = {}
        """Closed session id → why (``closed``, or the eviction reason)."""
        self.evicted = 0
        """Sessions dropped so far (idle or table full)."""

    def closed_reason(self, sid: str) -> Optional[str]:
        return self.closed.get(sid)

    def touch(self, session: SessionRecord) -> None:
        """Mark activity: the session moves to the back of the eviction order."""
        session.last_active = time.monotonic()
        if self.open.get(session.session_id) is session:
            self.open[session.session_id] = self.open.pop(session.session_id)

    def admit(self, sid: str) -> SessionRecord:
        """The open session ``sid``, created (after pruning) when new. ``ValueError`` if it was closed."""
        reason = self.closed.get(sid)
        if reason is not None:
            raise ValueError(f"session {sid!r} is closed ({reason})")
        session = self.open.get(sid)
        if session is None:
            self.prune()
            session = self.open[sid] = SessionRecord(sid)
        self.touch(session)
        return session

    def prune(self) -> None:
        """Drop sessions idle past ``idle_s``; then, at ``max_sessions``, the least recently active idle one."""
        cutoff = time.monotonic() - self.idle_s
        for sid, s in list(self.open.items()):
            if s.last_active > cutoff:
                break
            if s.in_flight == 0:
                self._evict(sid, f"expired: no activity for more than {self.idle_s:g} s")
        if len(self.open) < self.max_sessions:
            return
        oldest = next((sid for sid, s in self.open.items() if s.in_flight == 0), None)
        if oldest is None:
            raise SessionTableFull(
                f"the proxy holds max_sessions={self.max_sessions} sessions, each with a call in flight"
            )
        self._evict(oldest, f"evicted: the proxy reached max_sessions={self.max_sessions}")

    def close(self, sid: str) -> SessionRecord:
        """End a session (later calls get 410); its record, or an empty one whose ``evicted`` says why it is gone."""
        reason = self.closed.get(sid)
        rec = self.open.pop(sid, None) or SessionRecord(sid, evicted=reason if reason != "closed" else None)
        self._remember(sid, "closed" if rec.evicted is None else rec.evicted)
        rec.closed = True
        return rec

    @contextlib.contextmanager
    def active(self, session: SessionRecord) -> Iterator[None]:
        """A call in flight on ``session``: never evicted meanwhile."""
        session.in_flight += 1
        self.touch(session)
        try:
            yield
        finally:
            session.in_flight -= 1
            self.touch(session)

    def stats(self) -> dict:
        """The table's size and bounds (``/health``)."""
        return {
            "sessions": len(self.open),
            "max_sessions": self.max_sessions,
            "session_idle_s": self.idle_s,
            "sessions_evicted": self.evicted,
            "closed_ids": len(self.closed),
        }

    def _evict(self, sid: str, reason: str) -> None:
        self.open.pop(sid, None)
        self.evicted += 1
        self._remember(sid, reason)

    def _remember(self, sid: str, reason: str) -> None:
        self.closed.pop(sid, None)
        self.closed[sid] = reason
        while len(self.closed) > CLOSED_IDS_PER_SESSION * self.max_sessions:
            del self.closed[next(iter(self.closed))]
