"""The engine thread's inbox: what coroutines hand the engine thread, as commands in one list, and the one place
that decides what the thread takes from it, and when.

Every command has ``run(engine)`` (``engine``: the ``LLMEngine``) and lives with the module it belongs to. "Held"
below means the engine is asleep or a sleep is queued (held requests and scoring run after the wake).

| command | module | wakes the thread | taken on a pass (under the lock) | runs |
| --- | --- | --- | --- | --- |
| ``AddRequest`` | inbox.py | unless held | unless held | at once: the sequence joins the scheduler's queue |
| ``AbortRequest`` | inbox.py | always | always | at once, after the pass's new requests |
| ``ScorePrompts`` | runners/scoring.py | unless held or paused | unless held or paused | first after the lock, in arrival order (a cancelled one is skipped) |
| ``SleepOrWake`` | runners/sleep.py | the first queued one, when it may go: a wake at once, a sleep once nothing runs or waits in the scheduler and no weight update is queued here (a request still in this inbox is held by it) | the same one | after the scoring, instead of the step |
| ``PendingUpdate`` | engine.py | awake and not paused, or asleep: always (also one already in the engine's queue while asleep); paused: when the first queued update needs no running sequence to finish (not ``wait_for_inflight``, or nothing runs) | always: handed to the engine's queue (``LLMEngine.pending_updates``) | at the next step's start (``LLMEngine.apply_ready_updates``); paused or asleep, alone in its pass (after a level-2 sleep into weights allocated again first) |

Awake and not paused, the engine's own work (running or waiting sequences, queued updates) wakes the thread too.
After the lock (``Pass.run``): the scoring, then the sleep or wake if one was taken; else, paused or asleep, only
the updates that may go; else one step, when there is work or nothing was scored.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Optional

from training.deployment.engine.engine import LLMEngine, PendingUpdate
from training.deployment.engine.runners.scoring import ScorePrompts
from training.deployment.engine.runners.sleep import SleepOrWake
from training.deployment.engine.sequence import Sequence


@dataclass
class AddRequest:
    """A new sequence for the scheduler's queue."""

    seq: Sequence

    def run(self, engine: LLMEngine) -> None:
        engine.add(self.seq)


@dataclass
class AbortRequest:
    """Finish ``seq`` with ``abort`` (a no-op once it finished)."""

    seq: Sequence

    def run(self, engine: LLMEngine) -> None:
        engine.abort(self.seq)


@dataclass
class Pass:
    """What one pass of the engine thread took from the inbox (module docstring)."""

    paused: bool
    """Paused or asleep when it was taken: no step runs, only the updates that may go."""
    requests: list[AddRequest] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    updates: list[PendingUpdate] = field(default_factory=list)
    scores: list[ScorePrompts] = field(default_factory=list)
    sleep: Optional[SleepOrWake] = None

    def run_at_once(self, engine: LLMEngine) -> None:
        """Under the inbox's lock: new requests join the queue, aborts apply, updates go to the engine's queue."""
        for command in self.requests:
            command.run(engine)
        for command in self.aborts:
            command.run(engine)
        engine.pending_updates.extend(self.updates)

    def run(self, engine: LLMEngine) -> None:
        """After the lock: the scoring, then the sleep or wake, or the updates that may go, or one step."""
        for job in self.scores:
            job.run(engine)
        if self.sleep is not None:
            self.sleep.run(engine)
        elif self.paused:
            if engine.memory.level == 2 and engine.pending_updates:
                engine.memory.restore_weights()  # a push to a level-2 sleeper lands; the KV cache stays freed
            engine.apply_ready_updates()
        elif engine.has_work() or not self.scores:
            engine.step()


class Inbox:
    """The commands waiting for the engine thread, in arrival order; its owner's lock guards every call."""

    def __init__(self):
        self.commands: list = []
        self._count: Counter = Counter()
        """Queued commands per class, and ``"sleeps"``: queued sleeps (level 1 / 2, not wakes)."""

    def post(self, command) -> None:
        """Queue ``command`` (one of the table's) behind every earlier one."""
        self.commands.append(command)
        self._counted(command)

    def requests(self) -> int:
        """New sequences queued here (not yet in the scheduler's queue)."""
        return self._count[AddRequest]

    def holding(self, engine: LLMEngine) -> bool:
        """New requests and scoring stay here: the engine sleeps or is about to (they run after the wake)."""
        return engine.memory.level > 0 or self._count["sleeps"] > 0

    def _first_sleep(self) -> Optional[SleepOrWake]:
        if not self._count[SleepOrWake]:
            return None
        return next(c for c in self.commands if isinstance(c, SleepOrWake))

    def _sleep_may_go(self, command: SleepOrWake, engine: LLMEngine) -> bool:
        """A wake goes at once; a sleep once nothing runs or waits in the scheduler and no update is queued here."""
        return command.level == 0 or (not engine.has_work() and not self._count[PendingUpdate])

    def ready(self, engine: LLMEngine, paused: bool) -> bool:
        """Whether the engine thread has something to do (the module docstring's table)."""
        head = self._first_sleep()
        if head is not None and self._sleep_may_go(head, engine):
            return True
        holding = self.holding(engine)
        if (self._count[AddRequest] and not holding) or self._count[AbortRequest]:
            return True
        if self._count[ScorePrompts] and not (holding or paused):
            return True
        if engine.memory.level:  # asleep: only weight updates proceed (they land in the restored weights)
            return bool(self._count[PendingUpdate] or engine.pending_updates)
        if paused:  # only a weight update that needs no running step may proceed
            first = next((c for c in self.commands if isinstance(c, PendingUpdate)), None)
            if first is None and engine.pending_updates:
                first = engine.pending_updates[0]
            return first is not None and (not first.wait_for_inflight or not engine.scheduler.running)
        return bool(self._count[PendingUpdate]) or engine.has_work()

    def take(self, engine: LLMEngine, paused: bool) -> Pass:
        """Remove and return what this pass takes (the module docstring's table); the rest waits, in order."""
        holding = self.holding(engine)
        head = self._first_sleep()
        sleep = head if head is not None and self._sleep_may_go(head, engine) else None
        taken = Pass(paused=paused or engine.memory.level > 0, sleep=sleep)
        kept = []
        for command in self.commands:
            if isinstance(command, AddRequest) and not holding:
                taken.requests.append(command)
            elif isinstance(command, ScorePrompts) and not (holding or paused):
                taken.scores.append(command)
            elif isinstance(command, AbortRequest):
                taken.aborts.append(command)
            elif isinstance(command, PendingUpdate):
                taken.updates.append(command)
            elif command is not sleep:
                kept.append(command)
        self._recount(kept)
        return taken

    def drain(self) -> list:
        """Remove and return every queued command (at shutdown)."""
        commands = self.commands
        self._recount([])
        return commands

    def _recount(self, commands: list) -> None:
        self.commands, self._count = commands, Counter()
        for command in commands:
            self._counted(command)

    def _counted(self, command) -> None:
        self._count[type(command)] += 1
        if isinstance(command, SleepOrWake) and command.level > 0:
            self._count["sleeps"] += 1
